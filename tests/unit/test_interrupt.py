"""The driver's signal handling while a run trains (raytrain/interrupt.py, issue 54 item 2), without Ray: the first
SIGINT or SIGTERM asks for a stop and says so, the exit code is 128 + the signal, a second one stops at once, and the
handlers before are back afterwards. The stop itself, end to end: tests/integration/test_operator.py."""
from __future__ import annotations

import os
import signal

import pytest

from minimind_ray.raytrain.interrupt import StopRequest, stop_on_signals


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_first_signal_asks_for_a_stop_and_the_second_stops_at_once(signum, code, capsys):
    before = signal.getsignal(signum)
    stop = StopRequest()
    with stop_on_signals(stop):
        os.kill(os.getpid(), signum)
        assert stop.asked and stop.exit_code == code
        assert "stopping at the next step the workers check, with a checkpoint" in capsys.readouterr().out
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signum)
        assert "second interrupt: stopping at once" in capsys.readouterr().out
    assert signal.getsignal(signum) is before
