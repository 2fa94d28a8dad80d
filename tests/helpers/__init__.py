"""Helpers shared by the tests (importable as ``helpers``: pytest puts ``tests/`` on ``sys.path`` for the rootdir
conftest)."""
