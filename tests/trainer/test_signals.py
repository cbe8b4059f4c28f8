"""Stop signals: the first asks the loop to stop after its iteration, a second aborts."""

from __future__ import annotations

import os
import signal

import pytest

from proxima.trainer.signals import StopSignals, should_stop


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_first_signal_asks_to_stop_second_aborts(sig, capfd):
    before = signal.getsignal(sig)
    with StopSignals() as signals:
        assert should_stop(signals, None) is None
        os.kill(os.getpid(), sig)
        assert signals.received == sig and signals.name == signal.Signals(sig).name
        assert should_stop(signals, None) == "signal"
        assert "received: finishing this iteration" in capfd.readouterr().err
        with pytest.raises(KeyboardInterrupt, match="aborted at once"):
            os.kill(os.getpid(), sig)
    assert signal.getsignal(sig) is before  # the previous handler is back
