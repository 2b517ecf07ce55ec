"""nandoctor.watch under `python -m paddle.distributed.launch --nproc_per_node 2` (CPU, gloo, DataParallel).

Each case runs examples/distributed_train.py through Paddle's own launcher in a subprocess with a hard
time limit, so a rank left waiting at a collective fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from inloop_helpers import EXAMPLES, ROOT

LIMIT = 150  # seconds for the whole launch: two Paddle start-ups, 12 steps, one replay


def _launch(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    report = tmp_path / "report"
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           str(tmp_path / "log"), str(EXAMPLES / "distributed_train.py"), "--report-dir", str(report), *extra]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT,
                              env={**_env(), "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the 2-process run did not finish in {LIMIT} s (a rank hung): {_logs(tmp_path)}")
    return proc.returncode, report


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_"))}


def _logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((tmp_path / "log").glob("workerlog.*")))


def _done(tmp_path: Path) -> list[str]:
    """The example's last line on each rank: every rank reached the end of its loop."""
    return [line for p in sorted((tmp_path / "log").glob("workerlog.*"))
            for line in p.read_text(errors="replace").splitlines() if line.startswith("rank ")]


def test_fault_on_rank_1_only_names_rank_1(tmp_path: Path) -> None:
    rc, report = _launch(tmp_path, "--fault-rank", "1")
    assert rc != 0, _logs(tmp_path)
    assert sorted(_done(tmp_path)) == ["rank 0: steps 7, fault True", "rank 1: steps 7, fault True"], _logs(tmp_path)
    merged = json.loads((report / "report.json").read_text(encoding="utf-8"))
    assert merged["verdict"] == "nan_found"
    ff = merged["first_fault"]
    assert (ff["step"], ff["phase"], ff["layer"], ff["op"], ff["sample_indices"]) == (
        6, "backward", "distance", "sqrt_grad", [3])
    assert merged["details"]["first_rank"] == 1 and merged["run"]["first_rank"] == 1 and ff["rank"] == 1
    assert merged["findings"][0]["location"]["rank"] == 1
    ranks = {r["rank"]: r for r in merged["details"]["ranks"]}
    # rank 0's gradients went NaN too, through DataParallel's all-reduce; only rank 1's batch does it alone
    assert ranks[0]["saw_nonfinite"] and not ranks[0]["own_fault"]
    assert ranks[1]["saw_nonfinite"] and ranks[1]["own_fault"] and ranks[1]["step"] == 6
    assert merged["findings"][0]["message"].startswith("Rank 1 of 2:")
    for r in (0, 1):
        assert (report / f"rank-{r}" / "report.json").is_file()
    assert (report / "rank-1" / "batch.npz").is_file()


def test_fault_on_every_rank(tmp_path: Path) -> None:
    rc, report = _launch(tmp_path, "--fault-rank", "all")
    assert rc != 0
    merged = json.loads((report / "report.json").read_text(encoding="utf-8"))
    assert merged["details"]["first_rank"] == 0
    assert [r["own_fault"] for r in merged["details"]["ranks"]] == [True, True]
    assert merged["first_fault"]["step"] == 6 and merged["first_fault"]["sample_indices"] == [3]


def test_healthy_two_process_run(tmp_path: Path) -> None:
    rc, report = _launch(tmp_path)
    assert rc == 0, _logs(tmp_path)
    assert sorted(_done(tmp_path)) == ["rank 0: steps 12, fault False", "rank 1: steps 12, fault False"]
    assert not report.exists()


def _run_over_launcher(tmp_path: Path, *script_args: str) -> dict:
    """`nandoctor run` over `paddle.distributed.launch` of examples/unmodified_distributed.py (exit 1 asserted)."""
    cmd = [sys.executable, "-m", "nandoctor", "run", "--json", str(tmp_path / "r.json"), "-q", "--",
           sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           str(tmp_path / "log"), str(EXAMPLES / "unmodified_distributed.py"), *script_args]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT,
                              env={**_env(), "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"nandoctor run over 2 processes did not finish in {LIMIT} s: {_logs(tmp_path)}")
    assert proc.returncode == 1, proc.stderr[-2000:] + _logs(tmp_path)
    return json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))


def test_nandoctor_run_over_the_launcher_names_rank_1(tmp_path: Path) -> None:
    """Zero-change mode: the unmodified DataParallel script, every rank watched through the seams."""
    data = _run_over_launcher(tmp_path, "--fault-rank", "1")
    ff = data["first_fault"]
    assert (ff["step"], ff["layer"], ff["op"], ff["sample_indices"]) == (6, "distance", "sqrt_grad", [3])
    assert data["details"]["first_rank"] == 1 and ff["rank"] == 1
    assert [r["own_fault"] for r in data["details"]["ranks"]] == [False, True]


def test_nandoctor_run_over_the_launcher_names_the_rank_whose_code_raised(tmp_path: Path) -> None:
    """Rank 1's own forward raises at step 3 while rank 0 waits in DataParallel's all-reduce: the report is
    rank 1's user_code.error (it used to be the launcher's exit status and no report)."""
    data = _run_over_launcher(tmp_path, "--raise-rank", "1")
    assert data["verdict"] == "crashed"
    ff = data["first_fault"]
    assert (ff["rank"], ff["step"], ff["phase"], ff["layer"]) == (1, 3, "forward", "encoder.0")
    assert data["findings"][0]["code"] == "user_code.error"
    assert data["findings"][0]["message"].startswith("Rank 1 of 2")


_DATA = '''
import numpy as np
import paddle


def batches(bad_global_batch=-1):
    rng = np.random.default_rng(2)
    out = []
    for i in range(24):
        a = rng.normal(size=(8, 10)).astype("float32")
        b = a + rng.normal(scale=0.5, size=a.shape).astype("float32")
        if i == bad_global_batch:
            b[3] = a[3]  # the duplicated pair
        out.append((a, b, np.linalg.norm(a - b, axis=1).astype("float32")))
    return out


class Pairs(paddle.io.Dataset):
    def __init__(self):
        self.items = [(a[i], b[i], t[i]) for a, b, t in batches() for i in range(len(a))]

    def __getitem__(self, i):
        return self.items[i]

    def __len__(self):
        return len(self.items)


def loader():
    return paddle.io.DataLoader(Pairs(), batch_size=8, shuffle=False)
'''


def _probe_nproc(tmp_path: Path, data: str, args: dict) -> tuple[int, dict]:
    import yaml

    (tmp_path / "dp_data.py").write_text(_DATA, encoding="utf-8")
    spec = {"version": 1, "model": {"entry": f"{EXAMPLES / 'plain_loop.py'}:Siamese"},
            "data": {"entry": f"dp_data.py:{data}", "args": args, "fields": ["a", "b", "target"],
                     "inputs": ["a", "b"], "label": "target"},
            "loss": {"builtin": "mse"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.003}}}
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    cmd = [sys.executable, "-m", "nandoctor", "probe", str(tmp_path / "dp.yaml"), "--steps", "8", "--nproc", "2",
           "--json", str(tmp_path / "r.json"), "-q"]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT, env=_env())
    except subprocess.TimeoutExpired:
        pytest.fail(f"probe --nproc 2 did not finish in {LIMIT} s")
    assert (tmp_path / "r.json").is_file(), proc.stderr[-3000:]
    return proc.returncode, json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))


def test_probe_nproc_names_the_rank_that_got_the_bad_batch(tmp_path: Path) -> None:
    # two ranks take every other batch of a plain list: global batch 7 is rank 1's batch 3
    rc, data = _probe_nproc(tmp_path, "batches", {"bad_global_batch": 7})
    assert rc == 1
    ff = data["first_fault"]
    assert (ff["rank"], ff["step"], ff["batch_index"], ff["layer"], ff["op"], ff["sample_indices"]) == (
        1, 3, 3, "distance", "sqrt_grad", [3])
    assert data["run"]["nproc"] == 2 and "--nproc 2" in data["run"]["command_line"]


def test_probe_nproc_shards_a_dataloader_and_finds_nothing_when_healthy(tmp_path: Path) -> None:
    rc, data = _probe_nproc(tmp_path, "loader", {})
    assert rc == 0 and data["verdict"] == "healthy" and data["first_fault"] is None
    assert len(data["timeline"]) == 8  # 12 batches per rank through DistributedBatchSampler; 8 steps asked


def test_watch_starts_no_collective_in_processes_that_joined_no_group(monkeypatch) -> None:
    """Independent processes under the launcher (PADDLE_TRAINERS_NUM set, no init_parallel_env): a per-step
    all-reduce of nandoctor's would wait for the other ranks until gloo times out, so there is none."""
    import paddle

    import nandoctor

    monkeypatch.setenv("PADDLE_TRAINERS_NUM", "2")
    monkeypatch.setenv("PADDLE_TRAINER_ID", "1")
    model = paddle.nn.Linear(4, 2)
    with nandoctor.watch(model, paddle.optimizer.SGD(parameters=model.parameters()), report_dir=None) as doctor:
        assert doctor.sync is None


_MISBEHAVING = '''
import os
import time

import paddle.nn as nn


class Net(nn.Layer):
    """Rank 1 misbehaves at its 4th forward (step 3): raises, is SIGKILLed, or hangs."""

    def __init__(self, how):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
        self.how, self.calls = how, 0

    def forward(self, a, b):
        self.calls += 1
        if os.environ.get("PADDLE_TRAINER_ID") == "1" and self.calls == 4:
            if self.how == "raise":
                raise ValueError("rank 1 alone hits this")
            if self.how == "kill":
                os.kill(os.getpid(), 9)
            time.sleep(3600)
        return self.body(a - b).squeeze(-1)
'''


@pytest.mark.parametrize(("how", "code"), [("raise", "user_code.error"), ("kill", "rank.killed"),
                                            ("hang", "rank.hung")])
def test_probe_nproc_names_a_rank_that_raises_is_killed_or_hangs(tmp_path: Path, how: str, code: str) -> None:
    """One rank's own failure stops the job with a report naming that rank, its step and phase (the other
    rank waits in DataParallel's all-reduce), and no rank is left running."""
    import yaml

    (tmp_path / "dp_data.py").write_text(_DATA, encoding="utf-8")
    (tmp_path / "bad_model.py").write_text(_MISBEHAVING, encoding="utf-8")
    spec = {"version": 1, "model": {"entry": "bad_model.py:Net", "args": {"how": how}},
            "data": {"entry": "dp_data.py:loader", "fields": ["a", "b", "target"], "inputs": ["a", "b"],
                     "label": "target"},
            "loss": {"builtin": "mse"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.003}}}
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    cmd = [sys.executable, "-m", "nandoctor", "probe", str(tmp_path / "dp.yaml"), "--steps", "8", "--nproc", "2",
           "--json", str(tmp_path / "r.json"), "-q"]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT,
                              env={**_env(), **({"NANDOCTOR_RANK_HANG_SECONDS": "6"} if how == "hang" else {})})
    except subprocess.TimeoutExpired:
        pytest.fail(f"probe --nproc 2 did not finish in {LIMIT} s")
    left = subprocess.run(["pgrep", "-af", str(tmp_path / "dp.yaml")], capture_output=True, text=True).stdout
    assert not left.strip(), f"ranks left running: {left}"
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert data["verdict"] == "crashed"
    ff = data["first_fault"]
    assert (ff["rank"], ff["step"], ff["phase"]) == (1, 3, "forward")
    first = data["findings"][0]
    assert first["code"] == code and first["location"]["rank"] == 1
    assert first["message"].startswith("Rank 1 of 2")
