"""reproduce.py never contradicts the probe: the same guards, losses, output selection and learning rate.

reproduce.py (nandoctor/standalone/reproduce.py) runs without nandoctor, so it cannot import the
probe's tables. The op guards reach it as data (`op_guards.json`, written from nandoctor.engine.op_guards);
the losses, the output selection and the LR scheduler are code on both sides, held equal here on the
same inputs. The end-to-end tests run the probe, then the bundle's reproduce.py in a fresh interpreter,
and check that both say the same about the fault and about the op_guard remedy.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_configs"
SCRIPT = ROOT / "nandoctor" / "standalone" / "reproduce.py"
FIXED_LINE = "no fault: with this remedy the step runs without NaN/Inf."


def _probe(config: Path, out: Path) -> dict[str, Any]:
    result = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(
        app, ["probe", str(config), "--bundle", str(out), "--quiet"])
    assert result.exit_code == 1, result.output
    return json.loads((out / "report.json").read_text())


def _reproduce(bundle: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """reproduce.py as a user runs it: a fresh interpreter, from another folder, nandoctor not imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(bundle / "reproduce.py"), *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=300)


def _row(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in report["remedies"] if r["remedy"] == name)


def _copy_sample(name: str, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for file in (SAMPLES / name).iterdir():
        if file.suffix in (".py", ".yaml"):
            shutil.copyfile(file, dest / file.name)
    return dest / "config.yaml"


@pytest.fixture(scope="module")
def script() -> dict[str, Any]:
    """reproduce.py's functions, loaded as a bundle loads them (nandoctor is not needed by it)."""
    return runpy.run_path(str(SCRIPT), run_name="bundle_reproduce")


def _random_tensors(seed: int) -> list[Any]:
    """Random values over many magnitudes plus every edge a guard cares about (0, +-1, 60, inf, nan)."""
    import numpy as np
    import paddle

    rng = np.random.default_rng(seed)
    edge = np.array([0.0, -0.0, 1e-13, -1e-13, 1e-12, 1.0, -1.0, 0.99999999, -0.99999999, 60.0, 61.0, -61.0,
                     np.inf, -np.inf, np.nan], dtype="float32")
    return [paddle.to_tensor(np.concatenate([rng.normal(size=25).astype("float32") * 10.0 ** rng.integers(-14, 3),
                                             edge])) for _ in range(2)]


# --- op guards: one table, carried as data --------------------------------------------------------------


def test_bundle_carries_the_probes_guard_table(script: dict[str, Any], tmp_path: Path):
    """op_guards.json is op_guards' own table, and reproduce.py resolves every op name (grad, alias) to the
    guard the probe's guard_for picks."""
    from nandoctor.engine.op_guards import ALIASES, GUARDS, bundle_table, guard_for
    from nandoctor.findings import Report
    from nandoctor.report.bundle import write_bundle
    from nandoctor.spec import load_spec

    report = Report(command="probe", remedies=[{"remedy": "op_guard", "change": "x", "outcome": "fixed"}])
    write_bundle(report, load_spec(SAMPLES / "sqrt_at_zero" / "config.yaml"), tmp_path / "b")
    table = json.loads((tmp_path / "b" / "op_guards.json").read_text())
    assert table == json.loads(json.dumps(bundle_table()))
    assert "op_guards.json" in (tmp_path / "b" / "README.txt").read_text()
    assert script["_guard_table_problems"](table) == []
    names = [*GUARDS, *ALIASES, "matmul", "softmax", "", None]
    for name in names + [f"{n}_grad" for n in names if n]:
        expected = guard_for(name)
        assert script["guard_op"](table, name) == (expected.op if expected else None), name
        if expected is not None:
            entry = table["guards"][expected.op]
            assert (tuple(entry["functions"]), tuple(entry["methods"])) == (expected.functions, expected.methods)
    # a bundle whose report has no op_guard remedy carries no table
    write_bundle(Report(command="probe"), load_spec(SAMPLES / "sqrt_at_zero" / "config.yaml"), tmp_path / "c")
    assert not (tmp_path / "c" / "op_guards.json").exists()


@pytest.mark.parametrize("op", ["sqrt", "rsqrt", "log", "exp", "pow", "divide", "acos"])
def test_guard_rules_change_arguments_as_the_probe_does(script: dict[str, Any], op: str):
    """The same epsilon/clamp on the same inputs, bit for bit; the same calls left alone."""
    import numpy as np

    from nandoctor.engine.op_guards import _guarded_args, bundle_table

    rule = json.loads(json.dumps(bundle_table()))["guards"][op]
    for seed in range(3):
        x, d = _random_tensors(seed)
        for args in [(x,), (x, d), (x, 2.0), (2.0, x), ()]:
            probe, bundle = _guarded_args(op, args), script["guarded_args"](rule, args)
            assert (probe is args) == (bundle is args), (op, len(args))
            assert len(probe) == len(bundle)
            for a, b in zip(probe, bundle):
                if hasattr(a, "numpy"):
                    assert np.array_equal(a.numpy(), b.numpy(), equal_nan=True), op
                else:
                    assert a == b


GUARDED_CODE = ("import paddle\n\n\ndef inner(x):\n    return paddle.sqrt(x)\n\n\n"
                "def outer(x):\n    a = paddle.sqrt(x)\n    b = inner(x)\n    return a + b + x.sqrt()\n")


@pytest.mark.parametrize("scope", ["line", "within", "any"])
@pytest.mark.parametrize("line", [9, 10])
def test_guard_scopes_fire_where_the_probes_fire(script: dict[str, Any], tmp_path: Path, scope: str, line: int):
    """At the source line only, while that line's call runs, or everywhere: the same calls are guarded and
    the results are equal (line 9 makes a sqrt itself; line 10 only calls the function that does)."""
    import numpy as np
    import paddle

    from nandoctor.engine.op_guards import GUARDS, bundle_table, guarded

    (tmp_path / "guarded_mod_parity.py").write_text(GUARDED_CODE)
    sys.path.insert(0, str(tmp_path))
    try:
        import guarded_mod_parity as mod
    finally:
        sys.path.remove(str(tmp_path))
    source = f"guarded_mod_parity.py:{line} in outer"
    x = paddle.to_tensor(np.array([0.0, 4.0, 9.0], dtype="float32"))
    rule = json.loads(json.dumps(bundle_table()))["guards"]["sqrt"]
    originals = (paddle.sqrt, paddle.Tensor.sqrt)
    with guarded(GUARDS["sqrt"], source, scope) as probe_hits:
        probe_out = mod.outer(x).numpy()
    with script["guard"](rule, source, scope) as bundle_hits:
        bundle_out = mod.outer(x).numpy()
    assert bundle_hits["calls"] == probe_hits["calls"]
    assert np.array_equal(bundle_out, probe_out)
    assert probe_hits["calls"] == {"line": {9: 1, 10: 0}, "within": {9: 1, 10: 1}, "any": {9: 3, 10: 3}}[scope][line]
    assert (paddle.sqrt, paddle.Tensor.sqrt) == originals  # put back


@pytest.mark.parametrize("tamper", [
    {"format": "nandoctor.op_guards/0"},
    {"guards": {"sqrt": {"functions": ["os.system"], "methods": [], "kind": "add", "arg": 0, "value": 1e-12,
                         "lo": None, "hi": None}}},
    {"guards": {"sqrt": {"functions": ["sqrt"], "methods": [], "kind": "eval", "arg": 0, "value": 1e-12,
                         "lo": None, "hi": None}}},
    {"guards": {"sqrt": {"functions": ["sqrt"], "methods": [], "kind": "add", "arg": 0, "value": "1e-12",
                         "lo": None, "hi": None}}},
    {"aliases": {"elementwise_pow": "nothing"}},
])
def test_reproduce_refuses_a_guard_table_nandoctor_did_not_write(tmp_path: Path, tamper: dict[str, Any]):
    from nandoctor.engine.op_guards import bundle_table

    shutil.copyfile(SCRIPT, tmp_path / "reproduce.py")
    (tmp_path / "op_guards.json").write_text(json.dumps(bundle_table() | tamper))
    module = runpy.run_path(str(tmp_path / "reproduce.py"), run_name="bundle_reproduce")
    with pytest.raises(module["BundleError"], match="not a guard table nandoctor wrote"):
        module["load_guards"]()


# --- losses and output selection: code on both sides, held equal -----------------------------------------


def test_builtin_losses_compute_what_the_probe_computes(script: dict[str, Any]):
    import numpy as np
    import paddle

    from nandoctor.spec import BUILTIN_LOSSES
    from nandoctor.workload.build import builtin_loss

    assert set(script["BUILTIN_LOSSES"]) == set(BUILTIN_LOSSES)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(8, 5)).astype("float32") * 3
    column = rng.normal(size=(8, 1)).astype("float32")
    labels = {
        "cross_entropy": [(logits, rng.integers(0, 5, 8).astype("int64")),
                          (logits, rng.integers(0, 5, (8, 1)).astype("int32")),
                          (logits, rng.integers(0, 5, 8).astype("float32"))],
        "mse": [(column, rng.normal(size=8).astype("float32")), (column, rng.normal(size=(8, 1)).astype("float64"))],
        "l1": [(column, rng.normal(size=8).astype("float32")), (column, rng.integers(0, 3, 8).astype("int64"))],
        "bce_with_logits": [(column, rng.integers(0, 2, 8).astype("int64")),
                            (column, rng.random((8, 1)).astype("float32"))],
    }
    assert set(labels) == set(BUILTIN_LOSSES)
    for name, cases in labels.items():
        for out, label in cases:
            values, grads = [], []
            for fn in (builtin_loss(name), script["builtin_loss"](name)):
                o = paddle.to_tensor(out, stop_gradient=False)
                loss = fn(o, paddle.to_tensor(label))
                loss.backward()
                values.append(loss.numpy())
                grads.append(o.grad.numpy())
            assert np.array_equal(values[0], values[1]), (name, label.dtype, label.shape)
            assert np.array_equal(grads[0], grads[1]), (name, label.dtype, label.shape)
    with pytest.raises(script["BundleError"]):
        script["builtin_loss"]("hinge")


class _Out:
    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


class _Mapping(Mapping):  # a Mapping that is not a dict
    def __init__(self, **values: Any) -> None:
        self._values = values

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Any:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def test_spec_numbers_read_as_the_probe_reads_them(script: dict[str, Any], tmp_path: Path):
    """spec.yaml's numbers, exponent forms included, are the same values in reproduce.py as in the probe."""
    import yaml

    from nandoctor.spec.yaml_file import read_yaml

    text = "a: [1e-4, 1.0e36, -1e5, 1.0e-4, .5, 3, 1_000, .inf, abc, '1e-4', 1e, v1e5, 1.2.3]\n"
    (tmp_path / "spec.yaml").write_text(text)
    ours = read_yaml(tmp_path / "spec.yaml")["a"]
    assert ours[:7] == [1e-4, 1e36, -1e5, 1e-4, 0.5, 3, 1000] and ours[8:] == ["abc", "1e-4", "1e", "v1e5", "1.2.3"]
    assert yaml.load(text, Loader=script["_SpecLoader"])["a"] == ours


def test_output_selection_picks_what_the_probe_picks(script: dict[str, Any]):
    """Every kind of output against every kind of selector: the same tensor, or an error on both sides."""
    import numpy as np
    import paddle

    from nandoctor.errors import SpecError
    from nandoctor.workload.outputs import select

    rng = np.random.default_rng(1)
    a, b, c = (paddle.to_tensor(rng.normal(size=(4, 3)).astype("float32")) for _ in range(3))
    outputs = [a, (a, b), [b, a, c], (), {"logits": a, "loss": b}, _Mapping(logits=b, loss=c),
               _Out(logits=a, loss=b), _Out(logits=c), {"logits": a}, (3.0, a)]
    selectors = [None, "loss", "logits", "hidden", 0, 1, -1, 2, 5, -4]
    agreed = 0
    for out in outputs:
        for sel in selectors:
            try:
                probe = select(out, sel, Path("spec.yaml"))
            except SpecError:
                probe = SpecError
            try:
                bundle = script["select_output"](out, sel)
            except script["BundleError"]:
                bundle = SpecError
            assert (probe is SpecError) == (bundle is SpecError), (type(out).__name__, sel)
            if probe is not SpecError:
                assert bundle is probe, (type(out).__name__, sel)
                agreed += 1
    assert agreed >= 20  # the cases are not all errors


# --- the LR scheduler: code on both sides, held equal ----------------------------------------------------


SCHEDULERS = {
    "named_with_base_rate": "{name: StepDecay, args: {step_size: 3, gamma: 0.5}}",
    "named_without_base_rate": "{name: PiecewiseDecay, args: {boundaries: [4, 9], values: [0.1, 0.05, 0.01]}}",
    "warmup_only": "{warmup: {steps: 5, start_lr: 0.0}}",
    "named_with_warmup": "{name: CosineAnnealingDecay, args: {T_max: 10}, warmup: {steps: 4, start_lr: 0.01}}",
    "entry": "{entry: \"sched.py:build\", args: {gamma: 0.9}}",
}


@pytest.mark.parametrize("case", sorted(SCHEDULERS))
def test_scheduler_is_the_one_the_probe_builds(case: str, tmp_path: Path):
    """The same classes (LinearWarmup around the named one) and the same rate at each of 25 steps; and
    set_lr puts the optimizer at a recorded rate."""
    import paddle
    import yaml

    from nandoctor.spec import load_spec
    from nandoctor.workload.build import build_optimizer
    from nandoctor.workload.schedulers import build_scheduler

    bundle = tmp_path / "b"
    (bundle / "code").mkdir(parents=True)
    shutil.copyfile(SCRIPT, bundle / "reproduce.py")
    sched_code = ("import paddle\n\n\ndef build(gamma):\n"
                  "    return paddle.optimizer.lr.ExponentialDecay(learning_rate=0.2, gamma=gamma)\n")
    for folder in (tmp_path, bundle / "code"):
        (folder / "sched.py").write_text(sched_code)
    for name in ("model.py", "data.py"):
        (tmp_path / name).write_text(SCHEDULED_FILES[name])
    lr = "" if case == "named_without_base_rate" else "  args: {learning_rate: 0.1}\n"
    config = tmp_path / "config.yaml"
    config.write_text(SCHEDULED_FILES["config.yaml"].split("optimizer:")[0]
                      + f"optimizer:\n  name: SGD\n{lr}  lr_scheduler: {SCHEDULERS[case]}\n")
    module = runpy.run_path(str(bundle / "reproduce.py"), run_name="bundle_reproduce")
    probe = build_scheduler(load_spec(config))
    bundle_sched = module["build_scheduler"](yaml.safe_load(config.read_text()))

    def chain(s: Any) -> list[str]:
        return [type(s).__name__] + (chain(s.learning_rate) if hasattr(s, "learning_rate") and
                                     isinstance(s.learning_rate, paddle.optimizer.lr.LRScheduler) else [])

    assert chain(bundle_sched) == chain(probe)
    rates = [], []
    for _ in range(25):
        for sched, out in ((probe, rates[0]), (bundle_sched, rates[1])):
            out.append(float(sched()))
            sched.step()
    assert rates[0] == rates[1]
    assert len(set(rates[0])) > 1  # the schedule moves
    model = paddle.nn.Linear(2, 1)
    optimizer = module["build_optimizer"](yaml.safe_load(config.read_text()), model)
    assert chain(optimizer._learning_rate) == chain(build_optimizer(load_spec(config), model)._learning_rate)
    module["set_lr"](optimizer, 0.0123, 7)
    assert float(optimizer.get_lr()) == 0.0123


def test_set_lr_without_a_scheduler_and_the_rate_from_the_timeline(script: dict[str, Any]):
    import paddle

    optimizer = paddle.optimizer.SGD(learning_rate=0.5, parameters=paddle.nn.Linear(2, 1).parameters())
    script["set_lr"](optimizer, 0.25, 3)
    assert float(optimizer.get_lr()) == 0.25
    report = {"timeline": [{"step": 2, "lr": 0.1}, {"step": 3, "lr": "inf"}, {"step": 4}]}
    assert [script["step_lr"](report, s) for s in (2, 3, 4, 5, None)] == [0.1, float("inf"), None, None, None]


# --- end to end: the probe's op_guard verdict and reproduce.py's ---------------------------------------


def _library_sqrt(tmp_path: Path) -> Path:
    """sqrt_at_zero with the sqrt made in an installed library's code: the user's line only calls into it,
    so the probe's guard never fires at that line and widens to the calls made while it runs."""
    lib = tmp_path / "lib" / "site-packages"
    lib.mkdir(parents=True)
    (lib / "distlib_parity.py").write_text(
        "import paddle\n\n\ndef distance(ea, eb):\n    return paddle.sqrt(((ea - eb) ** 2).sum(axis=-1))\n")
    config = _copy_sample("sqrt_at_zero", tmp_path / "proj")
    model = config.parent / "model.py"
    text = model.read_text()
    text = text.replace("import paddle\n", f"import sys\n\nimport paddle\n\nsys.path.insert(0, {str(lib)!r})\n"
                        "import distlib_parity  # noqa: E402\n", 1)
    text = text.replace("return paddle.sqrt(((ea - eb) ** 2).sum(axis=-1))", "return distlib_parity.distance(ea, eb)")
    assert "distlib_parity.distance" in text
    model.write_text(text)
    return config


def _tensor_exponent(tmp_path: Path) -> Path:
    """neg_fractional_pow with the exponent a tensor: the checker names the op elementwise_pow (an alias)."""
    config = _copy_sample("neg_fractional_pow", tmp_path / "proj")
    model = config.parent / "model.py"
    text = model.read_text().replace("return x ** self.exponent", "return x ** paddle.to_tensor(self.exponent)")
    assert "paddle.to_tensor(self.exponent)" in text
    model.write_text(text)
    return config


@pytest.mark.parametrize(("case", "op", "scope"), [
    ("exp_overflow", "exp", "line"),
    ("log_of_zero", "log", "line"),
    ("library_sqrt", "sqrt_grad", "within"),  # today's reproduce.py guarded the line only: "not fixed"
    ("tensor_exponent", "elementwise_pow", "line"),  # today's reproduce.py: "no guard for op" (exit 2)
])
def test_op_guard_fixed_in_the_probe_is_fixed_in_reproduce(case: str, op: str, scope: str, tmp_path: Path):
    if (SAMPLES / case).is_dir():
        config = SAMPLES / case / "config.yaml"
    else:
        config = {"library_sqrt": _library_sqrt, "tensor_exponent": _tensor_exponent}[case](tmp_path)
    report = _probe(config, tmp_path / "b")
    assert report["first_fault"]["op"] == op
    row = _row(report, "op_guard")
    assert row["outcome"] == "fixed", row
    assert row["guard"]["scope"] == scope
    done = _reproduce(tmp_path / "b", tmp_path, "--with-remedy", "op_guard")
    assert done.returncode == 0, done.stdout + done.stderr
    assert FIXED_LINE in done.stdout.splitlines()
    # Without the remedy the bundle still reproduces the reported fault.
    plain = _reproduce(tmp_path / "b", tmp_path)
    assert plain.returncode == 1, plain.stdout + plain.stderr
    assert f"first fault: op={op} " in plain.stdout


SCHEDULED_FILES = {
    "model.py": ("import paddle\n\n\ndef build_model():\n    paddle.seed(0)\n"
                 "    return paddle.nn.Linear(4, 1)\n"),
    "data.py": ("import numpy as np\n\n\ndef build_loader(batches=10):\n    rng = np.random.default_rng(0)\n"
                "    for _ in range(batches):\n        x = rng.normal(0, 10, size=(16, 4)).astype('float32')\n"
                "        yield x, np.full((16, 1), 1.0e4, dtype='float32')\n"),
    # SGD at 1e-9 for three steps, then 1e36 (finite in float32): the gradients (~1e5, the targets are 1e4)
    # times that rate overflow in the update at step 3. optimizer.args holds no learning_rate at all.
    "config.yaml": ("version: 1\nmodel: {entry: \"model.py:build_model\"}\n"
                    "data: {entry: \"data.py:build_loader\", fields: [x, y], label: y}\n"
                    "loss: {builtin: mse}\n"
                    "optimizer:\n  name: SGD\n"
                    "  lr_scheduler: {name: PiecewiseDecay, args: {boundaries: [3], values: [1.0e-9, 1.0e36]}}\n"
                    "probe: {steps: 8, seed: 0, device: cpu}\n"),
}


def test_reproduce_steps_the_optimizer_with_the_schedulers_rate_at_the_failing_step(tmp_path: Path):
    """Today's reproduce.py built SGD at its default rate 0.001 and said "no fault" (exit 0)."""
    for name, text in SCHEDULED_FILES.items():
        (tmp_path / name).write_text(text)
    report = _probe(tmp_path / "config.yaml", tmp_path / "b")
    fault = report["first_fault"]
    assert (fault["step"], fault["phase"], fault["op"]) == (3, "optimizer", "sgd_")
    assert [p["lr"] for p in report["timeline"] if p["step"] in (2, 3)] == [1e-9, 1e36]
    done = _reproduce(tmp_path / "b", tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "learning rate at step 3: 1e+36 (PiecewiseDecay, from report.json's timeline)" in done.stdout
    assert "first fault: op=sgd_ phase=optimizer layer=-" in done.stdout
    assert "matches the report: yes" in done.stdout
