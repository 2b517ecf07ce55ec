"""Library log lines (INFO/WARNING) during a run are held back from the terminal, counted and kept."""

from __future__ import annotations

import io
import logging
import textwrap
from pathlib import Path

import pytest

from nandoctor.engine.userlogs import capture_library_logs


@pytest.fixture
def chatty_logger():
    """A library logger the way model zoos set one up: its own stderr handler, not propagating."""
    logger = logging.getLogger("zoo.modeling")
    handler = logging.StreamHandler(io.StringIO())  # stands for the terminal the library writes to
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, handler.stream
    logger.removeHandler(handler)
    logger.propagate = True
    logger.setLevel(logging.NOTSET)


def test_info_and_warning_are_held_back_errors_pass(chatty_logger: tuple[logging.Logger, io.StringIO],
                                                    caplog: pytest.LogCaptureFixture):
    chatty_logger, terminal = chatty_logger
    original = logging.Logger.callHandlers
    with capture_library_logs(keep=3) as logs:
        for i in range(5):
            chatty_logger.info("loading shard %d of 5", i)
        chatty_logger.warning("using the default tokenizer")
        logging.getLogger("other").warning("root-level warning")  # would reach logging's last resort
        chatty_logger.error("checkpoint is missing keys")
    assert "loading shard" not in terminal.getvalue() and "default tokenizer" not in terminal.getvalue()
    assert "root-level warning" not in caplog.text  # no handler of the root saw it either
    assert "checkpoint is missing keys" in terminal.getvalue()  # an error may explain a crash: it still shows
    details = logs.as_details()
    assert details["count"] == 7
    assert details["lines"] == ["INFO zoo.modeling: loading shard 4 of 5",
                                "WARNING zoo.modeling: using the default tokenizer",
                                "WARNING other: root-level warning"]
    assert logging.Logger.callHandlers is original  # restored
    chatty_logger.info("after the run")
    assert "after the run" in terminal.getvalue()


def test_nandoctors_own_logs_are_not_held_back(caplog: pytest.LogCaptureFixture):
    with capture_library_logs() as logs:
        logging.getLogger("nandoctor.probe").warning("our own warning")
        logging.getLogger("zoo").warning("theirs")
    assert [r.getMessage() for r in caplog.records] == ["our own warning"] and logs.count == 1


def test_a_probe_run_under_the_capture_prints_no_library_lines(tmp_path: Path, capfd: pytest.CaptureFixture,
                                                               caplog: pytest.LogCaptureFixture):
    """The run as run.py wraps it: the user's model logs while it is built and on every forward."""
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    (tmp_path / "model.py").write_text(textwrap.dedent("""\
        import logging

        import paddle

        log = logging.getLogger("zoo.layers")
        log.setLevel(logging.INFO)
        logging.basicConfig(level=logging.INFO)


        class Net(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                log.info("initialising Net with default config")
                self.lin = paddle.nn.Linear(3, 2)

            def forward(self, x):
                log.warning("forward called with batch of %d", x.shape[0])
                return self.lin(x)


        def build_model():
            return Net()
        """))
    (tmp_path / "data.py").write_text("import numpy as np\n\n\ndef build_loader():\n"
                                      "    r = np.random.default_rng(0)\n"
                                      "    return [(r.normal(size=(4, 3)).astype('float32'), np.array([0, 1, 0, 1]))"
                                      " for _ in range(3)]\n")
    (tmp_path / "config.yaml").write_text('version: 1\nmodel: {entry: "model.py:build_model"}\n'
                                          'data: {entry: "data.py:build_loader"}\nloss: {builtin: cross_entropy}\n')
    spec = load_spec(tmp_path / "config.yaml")
    root_handlers = list(logging.getLogger().handlers)
    try:
        with capture_library_logs() as logs:
            report = run_probe(spec, ProbeOptions(steps=3, device="cpu"))
    finally:
        for h in logging.getLogger().handlers:
            if h not in root_handlers:
                logging.getLogger().removeHandler(h)
    _, err = capfd.readouterr()
    assert "initialising Net" not in err and "forward called" not in err
    assert not [r for r in caplog.records if r.name == "zoo.layers"]  # no handler anywhere saw them
    assert report.exit_code == 0
    assert logs.count >= 4  # one at build, one per forward (3 steps), more if a replay ran
    assert logs.as_details()["lines"][0] == "INFO zoo.layers: initialising Net with default config"
