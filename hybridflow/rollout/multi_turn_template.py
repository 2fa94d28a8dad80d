"""Observation tokens from the tokenizer's chat template, rendered as a delta independent of earlier turns.

A multi-turn record is built by appending, never by re-rendering: rendering the whole history again and diffing
two renders breaks with templates that render earlier turns differently from how they were sampled (reasoning
templates drop earlier ``<think>`` blocks, some collapse whitespace), and it would re-tokenize the model's text.
Instead, each new message is rendered after a fixed dummy conversation: ``render(DUMMY + new,
add_generation_prompt=True)`` minus ``render(DUMMY)``, checking that the first starts with the second token for
token. The result depends on the new messages only, never on the real history.

The end-of-turn markup the template puts after an assistant message (``<|im_end|>\\n`` in ChatML) is found the
same way, from a dummy assistant message; after a model turn that stopped at a tool call, the rollout appends it
(minus the eos the model already sampled), with mask 0.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

__all__ = ["ChatDelta"]

_DUMMY_USER = {"role": "user", "content": "hello"}
_MARK = "zq"  # dummy assistant content, located in the render to find the end-of-turn markup


class ChatDelta:
    """Token deltas of a tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        tools: the tool schemas passed as ``tools=`` (the same the prompts were rendered with), or None.

    Raises:
        ValueError: the tokenizer has no chat template, it cannot render a ``tool`` message, or its rendering of
            a new message changes the tokens of the conversation before it (then no token-exact append exists;
            the message says which).
    """

    def __init__(self, tokenizer: Any, tools: Optional[Sequence[dict]] = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a tokenizer with a chat_template (observations are rendered "
                             "through it)")
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        self._prefix = [_DUMMY_USER, {"role": "assistant", "content": _MARK}]
        self._prefix_ids = self._encode(self._prefix, add_generation_prompt=False)
        mark = self.tokenizer.encode(_MARK, add_special_tokens=False)
        at = _last_occurrence(self._prefix_ids, mark)
        if at < 0:
            raise ValueError("cannot locate an assistant message's content in the chat template's rendering")
        self.end_of_turn: list[int] = self._prefix_ids[at + len(mark):]
        try:  # fail at construction, not at the first tool call, on a template without a tool role
            self.tool_observation([("probe", "probe")])
        except ValueError:
            raise
        except Exception as err:  # jinja2 raises TemplateError (or what the template's raise_exception raises)
            raise ValueError(f"the chat template cannot render a 'tool' message ({type(err).__name__}: {err}); "
                             "multi-turn rollouts need a template with a tool role (e.g. Qwen2/Hermes)") from None

    def _encode(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        kwargs = {"tools": self.tools} if self.tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def messages_delta(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids of ``messages`` (e.g. ``tool`` role results) followed by the generation prompt of the next
        assistant turn, as the template renders them after an assistant turn (its end markup excluded).

        Raises:
            ValueError: the render with the new messages does not start with the render without them.
        """
        full = self._encode(self._prefix + list(messages), add_generation_prompt=True)
        if full[: len(self._prefix_ids)] != self._prefix_ids:
            raise ValueError("the chat template renders the conversation before a new message differently once "
                             f"the message is added (roles {[m['role'] for m in messages]}); observations cannot be "
                             "appended token-exactly with this template")
        return full[len(self._prefix_ids):]

    def tool_observation(self, results: Sequence[tuple[Optional[str], str]]) -> list[int]:
        """Ids of one ``tool`` message per ``(tool name, result text)`` and the next generation prompt."""
        return self.messages_delta([{"role": "tool", "name": name or "", "content": text} for name, text in results])

    def close_turn(self, turn_ids: Sequence[int]) -> list[int]:
        """The end-of-turn markup still missing after a model turn ``turn_ids``: all of it, or all but its first
        token when the model sampled that token (an eos such as ``<|im_end|>``) as its last."""
        markup = self.end_of_turn
        if markup and turn_ids and turn_ids[-1] == markup[0]:
            return markup[1:]
        return list(markup)


def _last_occurrence(haystack: list[int], needle: list[int]) -> int:
    for start in range(len(haystack) - len(needle), -1, -1):
        if haystack[start:start + len(needle)] == needle:
            return start
    return -1
