"""The spec keys that say how real models train: model.output, keyword data.inputs, lr_scheduler, accumulation.

Parsing is checked on the spec alone; the workload tests build real Paddle models, optimizers and
schedulers from small projects written into tmp_path, and check what the user would see.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from nandoctor.errors import SpecError
from nandoctor.spec import load_spec
from nandoctor.workload.build import build_optimizer, build_workload, lr_scheduler

BASE = """\
version: 1
model: {entry: "models.py:build_model"}
data: {entry: "data.py:build_loader", fields: [x, y], label: y}
loss: {builtin: cross_entropy}
"""

MODELS = '''\
import paddle
import paddle.nn as nn


class Out:
    """An output object in the Hugging Face style: .loss and .logits."""

    def __init__(self, logits, loss=None):
        self.logits = logits
        self.loss = loss


def build_model(hidden=4, kind="plain"):
    paddle.seed(0)
    lin = nn.Linear(3, 2)

    class M(nn.Layer):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x=None, labels=None, scale=None):
            logits = self.lin(x if scale is None else x * scale)
            if kind == "dict":
                return {"logits": logits, "hidden": x}
            if kind == "tuple":
                return logits, x
            if kind == "object":
                loss = None
                if labels is not None:
                    loss = nn.functional.cross_entropy(logits, labels.astype("int64").unsqueeze(-1))
                return Out(logits, loss)
            return logits

    return M()


def build_kwargs(**kwargs):
    return build_model(**{k: v for k, v in kwargs.items() if k in ("hidden", "kind")})
'''

DATA = """\
import numpy as np


def build_loader(n=2):
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(4, 3)).astype("float32"), np.array([0, 1, 0, 1])) for _ in range(n)]
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "data.py").write_text(DATA)
    return tmp_path


def _write(project: Path, text: str) -> Path:
    path = project / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def _error(path: Path) -> str:
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return str(info.value)


# --- parsing -------------------------------------------------------------------------------------------

def test_new_keys_parse_into_the_typed_slots(project: Path):
    spec = load_spec(_write(project, """\
        version: 1
        model: {entry: "models.py:build_model", output: logits}
        data:
          entry: "data.py:build_loader"
          fields: [ids, mask, y]
          inputs: {input_ids: ids, attention_mask: mask}
          label: y
        loss: {builtin: cross_entropy}
        optimizer:
          name: AdamW
          args: {learning_rate: 1.0e-3}
          lr_scheduler: {name: CosineAnnealingDecay, args: {T_max: 100}, warmup: {steps: 10}, by: epoch}
          accumulate_steps: 4
        """))
    assert spec.model.output == "logits"
    assert spec.data.inputs == {"input_ids": "ids", "attention_mask": "mask"}
    sched = spec.optimizer.lr_scheduler
    assert sched is not None and sched.name == "CosineAnnealingDecay" and sched.args == {"T_max": 100}
    assert sched.warmup is not None and sched.warmup.steps == 10 and sched.warmup.start_lr == 0.0
    assert sched.by == "epoch" and spec.optimizer.accumulate_steps == 4


def test_output_index_and_own_loss(project: Path):
    spec = load_spec(_write(project, BASE.replace('build_model"}', 'build_model", output: 0}')))
    assert spec.model.output == 0
    own = BASE.replace('build_model"}', 'build_model", output: loss}').replace("loss: {builtin: cross_entropy}\n", "")
    spec = load_spec(_write(project, own))
    assert spec.model.output == "loss" and spec.loss is None and spec.step is None


@pytest.mark.parametrize("text, key, words", [
    (BASE.replace('build_model"}', 'build_model", output: true}'), "model.output", "`loss` when the model"),
    (BASE.replace('build_model"}', 'build_model", output: [0]}'), "model.output", "position in a returned tuple"),
    (BASE.replace('build_model"}', 'build_model", output: loss}'), "loss", "remove the `loss` block"),
    (BASE.replace('build_model"}', 'build_model", output: 0}').replace(
        "loss: {builtin: cross_entropy}", 'step: {entry: "s.py:step"}'), "model.output", "remove `model.output`"),
    (BASE.replace("label: y}", "label: y, inputs: {x: xx}}"), "data.inputs", "did you mean 'x'"),
    (BASE.replace("label: y}", "label: y, inputs: {2x: x}}"), "data.inputs.2x", "keyword argument"),
    (BASE.replace("label: y}", "label: y, inputs: {x: [x]}}"), "data.inputs.x", "name of the batch field"),
    (BASE.replace("label: y}", "label: y, inputs: {}}"), "data.inputs", "empty mapping"),
    (BASE.replace("label: y}", "label: y, inputs: {x: x, labels: y}}"), "data.inputs", "model.output: loss"),
    (BASE + "optimizer: {accumulate_steps: 0}\n", "optimizer.accumulate_steps", "whole number above 0"),
    (BASE + "optimizer: {accumulate_steps: true}\n", "optimizer.accumulate_steps", "whole number above 0"),
    (BASE + "optimizer: {lr_scheduler: {name: StepDecay, entry: 's.py:f'}}\n", "optimizer.lr_scheduler",
     "keep one"),
    (BASE + "optimizer: {lr_scheduler: {args: {T_max: 3}}}\n", "optimizer.lr_scheduler", "needs `name`"),
    (BASE + "optimizer: {lr_scheduler: {name: StepDecay, by: batch}}\n", "optimizer.lr_scheduler.by", "`epoch`"),
    (BASE + "optimizer: {lr_scheduler: {name: StepDecay, warmup: {step: 3}}}\n",
     "optimizer.lr_scheduler.warmup.step", "did you mean 'steps'"),
    (BASE + "optimizer: {lr_scheduler: {name: StepDecay, warmup: {steps: 0}}}\n",
     "optimizer.lr_scheduler.warmup.steps", "above 0"),
    (BASE + "optimizer: {lr_scheduler: {warmup: {steps: 5, start_lr: -1}}}\n",
     "optimizer.lr_scheduler.warmup.start_lr", ">= 0"),
    (BASE + "optimizer: {lr_scheduler: {name: StepDecay, args: {learning_rate: 0.1}}}\n",
     "optimizer.lr_scheduler.args.learning_rate", "optimizer.args.learning_rate"),
    (BASE + "optimizer: {lr_scheduler: {name: 3}}\n", "optimizer.lr_scheduler.name", "CosineAnnealingDecay"),
    (BASE + "optimizer: {lr_scheduler: {entry: 'nocolon'}}\n", "optimizer.lr_scheduler.entry", "file.py:function"),
])
def test_new_key_mistakes_name_the_key(project: Path, text: str, key: str, words: str):
    msg = _error(_write(project, text))
    assert f"`{key}`" in msg and words in msg


def test_label_as_a_keyword_input_when_the_model_computes_its_loss(project: Path):
    text = BASE.replace('build_model"}', 'build_model", output: loss}').replace(
        "label: y}", "label: y, inputs: {x: x, labels: y}}").replace("loss: {builtin: cross_entropy}\n", "")
    spec = load_spec(_write(project, text))
    assert spec.data.inputs == {"x": "x", "labels": "y"}


@pytest.mark.parametrize("value", ["true", '"1"', "1.0"])
def test_version_must_be_the_bare_number(project: Path, value: str):
    msg = _error(_write(project, BASE.replace("version: 1", f"version: {value}")))
    assert "`version` is" in msg and "set `version: 1`" in msg


BOMB = "version: 1\na: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")) + "model: *i\n"


@pytest.mark.parametrize("text, words", [
    (BOMB, "alias bomb"),
    ("version: 1\nmodel: " + "[" * 3000 + "]" * 3000 + "\n", "nests more than"),
    ("version: 1\nmodel: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "nests more than"),
    ("version: 1\nmodel: &m [1, *m]\n", "a loop"),
])
def test_yaml_bombs_and_deep_nesting_get_a_short_message(project: Path, text: str, words: str):
    msg = _error(_write(project, text))
    assert words in msg and "refused" in msg and len(msg) < 400


def test_a_few_anchors_still_work(project: Path):
    text = BASE.replace("version: 1\n", "version: 1\nshared: &args {hidden: 4}\n").replace(
        'build_model"}', 'build_model", args: *args}')
    msg = _error(_write(project, text))  # the anchor host key is unknown, but the alias itself is fine
    assert "`shared` is not a key" in msg
    spec = load_spec(_write(project, BASE.replace('build_model"}', 'build_model", args: &a {hidden: 4}}')))
    assert spec.model.args == {"hidden": 4}


# --- model.args / data.args against the factory's signature ----------------------------------------------

def test_model_args_key_the_factory_does_not_take(project: Path):
    spec = load_spec(_write(project, BASE.replace('build_model"}', 'build_model", args: {hiden: 8}}')))
    with pytest.raises(SpecError) as info:
        build_workload(spec)
    msg = str(info.value)
    assert "`model.args.hiden`" in msg and "Did you mean 'hidden'" in msg and "it takes: hidden, kind" in msg


def test_kwargs_factory_accepts_any_key_and_data_args_are_checked(project: Path):
    spec = load_spec(_write(project, BASE.replace("build_model", "build_kwargs").replace(
        'build_kwargs"}', 'build_kwargs", args: {anything: 1, hidden: 4}}')))
    build_workload(spec)
    spec = load_spec(_write(project, BASE.replace('build_loader"', 'build_loader", args: {m: 3}')))
    with pytest.raises(SpecError, match=r"`data.args.m` is not an argument of data.py:build_loader"):
        build_workload(spec)


# --- schedulers ------------------------------------------------------------------------------------------

def _optimizer(project: Path, opt: str) -> tuple[object, object]:
    spec = load_spec(_write(project, BASE + opt))
    workload = build_workload(spec)
    return build_optimizer(spec, workload.model), workload


def test_scheduler_by_name_takes_the_optimizer_rate_as_base(project: Path):
    import paddle

    opt, _ = _optimizer(project, "optimizer: {name: SGD, args: {learning_rate: 0.5}, "
                                 "lr_scheduler: {name: StepDecay, args: {step_size: 2, gamma: 0.1}}}\n")
    sched = lr_scheduler(opt)
    assert isinstance(sched, paddle.optimizer.lr.StepDecay) and opt.get_lr() == pytest.approx(0.5)
    sched.step()
    sched.step()
    assert opt.get_lr() == pytest.approx(0.05)


def test_warmup_wraps_the_scheduler_and_ramps_to_the_base_rate(project: Path):
    import paddle

    opt, _ = _optimizer(project, "optimizer: {name: SGD, args: {learning_rate: 0.4}, lr_scheduler: "
                                 "{name: CosineAnnealingDecay, args: {T_max: 100}, warmup: {steps: 4}}}\n")
    sched = lr_scheduler(opt)
    assert isinstance(sched, paddle.optimizer.lr.LinearWarmup)
    rates = []
    for _ in range(5):
        rates.append(opt.get_lr())
        sched.step()
    assert rates == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_warmup_alone_over_a_constant_rate(project: Path):
    opt, _ = _optimizer(project, "optimizer: {name: SGD, args: {learning_rate: 0.2}, "
                                 "lr_scheduler: {warmup: {steps: 2, start_lr: 0.1}}}\n")
    sched = lr_scheduler(opt)
    assert opt.get_lr() == pytest.approx(0.1)
    sched.step()
    sched.step()
    assert opt.get_lr() == pytest.approx(0.2)


def test_no_scheduler_means_none(project: Path):
    opt, _ = _optimizer(project, "optimizer: {name: SGD, args: {learning_rate: 0.2}}\n")
    assert lr_scheduler(opt) is None


@pytest.mark.parametrize("opt, words", [
    ("optimizer: {lr_scheduler: {name: CosineAnealingDecay, args: {T_max: 3}}}\n",
     "Did you mean 'CosineAnnealingDecay'"),
    ("optimizer: {args: {learning_rate: 0.1}, lr_scheduler: {name: OneCycleLR, args: {total_steps: 9}}}\n",
     "`optimizer.lr_scheduler.args.max_learning_rate`"),
    ("optimizer: {args: {learning_rate: 0.1}, lr_scheduler: {name: StepDecay, args: {step_sise: 3}}}\n",
     "It takes: learning_rate, step_size, gamma"),
    ("optimizer: {name: SGD, lr_scheduler: {name: StepDecay, args: {step_size: 3}}}\n",
     "set `optimizer.args.learning_rate`"),
    ("optimizer: {args: {learning_rate: 0.1}, lr_scheduler: {name: ReduceOnPlateau}}\n", "ReduceOnPlateau"),
    ("optimizer: {args: {learning_rate: 0.1}, lr_scheduler: {entry: 'models.py:Out', args: {logits: 1}}}\n",
     "must return a paddle.optimizer.lr.LRScheduler"),
])
def test_scheduler_mistakes_are_spec_errors(project: Path, opt: str, words: str):
    with pytest.raises(SpecError) as info:
        _optimizer(project, opt)
    assert words in str(info.value)


def test_scheduler_from_an_entry(project: Path):
    import paddle

    (project / "sched.py").write_text("import paddle\n\n\ndef build(rate=0.3):\n"
                                      "    return paddle.optimizer.lr.ExponentialDecay(rate, gamma=0.5)\n")
    opt, _ = _optimizer(project, "optimizer: {name: SGD, lr_scheduler: {entry: 'sched.py:build', "
                                 "args: {rate: 0.3}, warmup: {steps: 1}}}\n")
    sched = lr_scheduler(opt)
    assert isinstance(sched, paddle.optimizer.lr.LinearWarmup) and opt.get_lr() == pytest.approx(0.0)
    sched.step()
    assert opt.get_lr() == pytest.approx(0.3)


# --- keyword inputs and structured outputs ---------------------------------------------------------------

def _loss(project: Path, text: str, fields: dict[str, object] | None = None) -> object:
    workload = build_workload(load_spec(_write(project, text)))
    rng = np.random.default_rng(0)
    fields = fields or {"x": rng.normal(size=(4, 3)).astype("float32"), "y": np.array([0, 1, 0, 1])}
    return workload.compute_loss(workload.model, fields)


@pytest.mark.parametrize("kind, output", [("dict", "logits"), ("tuple", "0"), ("object", "logits")])
def test_model_output_picks_the_logits(project: Path, kind: str, output: str):
    import paddle

    text = BASE.replace('build_model"}', f'build_model", args: {{kind: {kind}}}, output: {output}}}')
    loss = _loss(project, text)
    plain = _loss(project, BASE)  # the same weights (seeded) returning the logits as they are
    assert isinstance(loss, paddle.Tensor) and float(loss) == pytest.approx(float(plain))


@pytest.mark.parametrize("kind, words", [
    ("dict", "a dict with keys ['logits', 'hidden']"),
    ("tuple", "a tuple of 2 ([0] Tensor[4, 2], [1] Tensor[4, 3])"),
    ("object", "a Out object with attributes ['logits', 'loss']"),
])
def test_builtin_loss_given_a_structure_says_what_to_write(project: Path, kind: str, words: str):
    text = BASE.replace('build_model"}', f'build_model", args: {{kind: {kind}}}}}')
    with pytest.raises(SpecError) as info:
        _loss(project, text)
    msg = str(info.value)
    assert words in msg and "`model.output`" in msg and "`loss.entry`" in msg and "`step.entry`" in msg
    assert "AttributeError" not in msg


def test_model_output_that_does_not_fit(project: Path):
    text = BASE.replace('build_model"}', 'build_model", args: {kind: dict}, output: logit}')
    with pytest.raises(SpecError, match=r"is 'logit', but the model returned a dict with keys \['logits'"):
        _loss(project, text)
    text = BASE.replace('build_model"}', 'build_model", args: {kind: tuple}, output: 5}')
    with pytest.raises(SpecError, match="pick a position from 0 to 1"):
        _loss(project, text)


def test_keyword_inputs_and_the_models_own_loss(project: Path):
    text = """\
        version: 1
        model: {entry: "models.py:build_model", args: {kind: object}, output: loss}
        data: {entry: "data.py:build_loader", fields: [x, y], inputs: {x: x, labels: y}}
        """
    loss = _loss(project, text)
    plain = _loss(project, BASE)
    assert float(loss) == pytest.approx(float(plain))
    with pytest.raises(SpecError, match="map them in `data.inputs`"):  # labels not passed: the model has no loss
        _loss(project, text.replace("inputs: {x: x, labels: y}", "inputs: {x: x}"))


def test_step_gets_tensors_and_must_not_call_backward(project: Path):
    import paddle

    (project / "train.py").write_text(textwrap.dedent("""\
        import paddle

        SEEN = []


        def step(model, batch):
            SEEN.append({k: type(v).__name__ for k, v in batch.items()})
            return paddle.nn.functional.cross_entropy(model(batch["x"]), batch["y"].unsqueeze(-1))


        def step_with_backward(model, batch):
            loss = step(model, batch)
            loss.backward()
            return loss
        """))
    text = BASE.replace("loss: {builtin: cross_entropy}", 'step: {entry: "train.py:step"}')
    fields = {"x": np.ones((4, 3), "float32"), "y": np.array([0, 1, 0, 1]), "text": np.array(["a"] * 4)}
    loss = _loss(project, text, fields)
    assert isinstance(loss, paddle.Tensor)
    import sys

    seen = next(m for n, m in sys.modules.items() if n.startswith("nandoctor_user_train_")).SEEN
    assert seen[-1] == {"x": "Tensor", "y": "Tensor", "text": "ndarray"}
    with pytest.raises(SpecError, match=r"step.entry must return the loss; nandoctor calls backward\(\)"):
        _loss(project, text.replace("train.py:step", "train.py:step_with_backward"), fields)


def test_model_args_may_use_any_name_the_factory_takes(tmp_path: Path) -> None:
    """`model.args` named like nandoctor's own helper arguments (`fn`, `what`, `base_dir`) reach the factory;
    they once collided with them and ended in exit 3 ("multiple values for argument 'fn'")."""
    (tmp_path / "models.py").write_text(
        "import paddle\n\n"
        "def build(fn=1, what='x', base_dir=None):\n"
        "    assert (fn, what, base_dir) == (4, 'head', 'here')\n"
        "    return paddle.nn.Linear(4, 2)\n\n"
        "def batches():\n"
        "    import numpy as np\n"
        "    rng = np.random.default_rng(0)\n"
        "    return [(rng.normal(size=(8, 4)).astype('float32'), rng.integers(0, 2, size=(8,))) for _ in range(3)]\n",
        encoding="utf-8")
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "version": 1, "model": {"entry": "models.py:build", "args": {"fn": 4, "what": "head", "base_dir": "here"}},
        "data": {"entry": "models.py:batches", "fields": ["x", "label"], "label": "label"},
        "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "SGD", "args": {"learning_rate": 0.1}}}),
        encoding="utf-8")
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    report = run_probe(load_spec(tmp_path / "c.yaml"), ProbeOptions(steps=3, seed=0, device="cpu"))
    assert report.verdict.value == "healthy", [f.message for f in report.findings]
    assert report.details["steps_run"] == 3
