"""The start-up clock: phases between marks, the total from the start, one line, then idle."""

from hybridflow.utils import startup


def test_phases_and_total_from_marks(monkeypatch):
    now = iter([100.0, 100.5, 102.0, 107.5, 108.0])
    monkeypatch.setattr(startup.time, "monotonic", lambda: next(now))
    startup.begin()  # 100.0
    startup.mark("config")  # 0.5 s
    startup.mark("Ray")  # 1.5 s
    startup.mark("worker processes")  # 5.5 s
    assert startup.summary() == ("start-up 8.0 s to the first step: config 0.5 s, Ray 1.5 s, "
                                 "worker processes 5.5 s")
    assert startup.summary() is None  # the clock stopped with the line
    startup.mark("ignored")  # no clock: nothing recorded, nothing raised


def test_begin_if_idle_keeps_a_running_clock(monkeypatch):
    now = iter([10.0, 11.0, 12.0, 13.0])
    monkeypatch.setattr(startup.time, "monotonic", lambda: next(now))
    startup.begin()  # 10.0: the command line began it
    startup.begin_if_idle()  # run_ppo: keeps the command line's start, reads no time
    startup.mark("data")  # 11.0
    assert startup.summary() == "start-up 2.0 s to the first step: data 1.0 s"


def test_process_start_clock_counts_time_before_begin():
    """From the process's start (Linux /proc): the total includes this test process's age so far."""
    age = startup._process_age_s()
    if age is None:  # not Linux: begin(from_process_start=True) starts now
        return
    assert age > 0.0
    startup.begin(from_process_start=True)
    line = startup.summary()
    total = float(line.split()[1])
    assert total >= age - 0.05
