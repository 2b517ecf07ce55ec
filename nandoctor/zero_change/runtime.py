"""Inside the user's unmodified script (`nandoctor run`): find the model, the loss, the batch and the
optimizer through Paddle's own seams, and drive a `Doctor` with them.

Loaded by the sitecustomize that `nandoctor run` puts first on PYTHONPATH; it patches Paddle only once
Paddle is imported, and only when NANDOCTOR_RUN is set (so the variable leaking into other programs
does nothing). The seams:

- `paddle.nn.Layer.__call__`: the outermost calls in training mode, each with its positional and
  keyword inputs, the RNG state before it, and the gradient that comes back to its outputs; the one
  whose parameters the optimizer trains is the model, and a layer called on the model's output is the
  loss (its other inputs are the label). Once both are known, the class patch is removed and forward
  hooks on those two layers take over, so the other layers keep Paddle's fast call path. Every
  optimizer the script steps is watched (a GAN's two): each gets its own model the same way, at its
  first update, from the outermost calls kept (after the patch is gone, hooks keep recording the
  outermost layers with parameters that no watch has yet); model_watch.py holds one such pair.
- `Tensor.backward`: the tensor backpropagated last is the loss.
- `Optimizer.step` (and `minimize`, which `paddle.Model.fit` uses): the check, between backward and the
  update; a faulty update is never applied.

Child processes the script starts (multiprocessing with fork or spawn, a new Python program) are each
watched on their own, and write their own result (processes.py).

Replays need the step's loss as a function of the batch. With a loss layer that is `loss(model(...),
label)`; with a model that returns its own loss (an output object's `.loss`), that loss; with a loss
written as functions, the gradient that came back to each of the model's output tensors is recorded
(one tensor hook each) and the replay backpropagates those same gradients through the model, which
reproduces every fault inside the model. A fault that began in loss code written as functions (the
model's outputs finite, the loss or the gradient coming back to them not) cannot be replayed here: it is
named as such (`loss_code_fault`), and a checked second pass of the command names its op, line and samples
(recheck.py, loss_samples.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nandoctor.zero_change.processes import OWN_ERROR, in_pool_worker

if TYPE_CHECKING:  # (loaded once Paddle is: numpy comes with them, ~60 ms a Python process that never trains)
    from nandoctor.zero_change.model_watch import ModelWatch

ENV = "NANDOCTOR_RUN"
_MAX_ROOTS = 16
_MAX_MISSES = 3  # updates of an optimizer whose model is not found before it is given up
_MAX_WATCHES = 8  # (model, optimizer) pairs watched at once
_MAX_CANDIDATES = 16  # outermost layers with parameters kept as possible models of later optimizers


class _Call:
    """One outermost training-mode layer call before the model is known: enough to replay it."""

    def __init__(self, layer: Any, args: tuple, kwargs: dict, rng: Any) -> None:
        self.layer, self.args, self.kwargs, self.rng = layer, args, kwargs, rng
        self.output: Any = None
        self.grads: dict[int, Any] = {}
        self.site: tuple[str, int, str] | None = None  # the user's line that made the call (call_site)


class Session:
    """The state of one watched process: every (model, optimizer) pair it trains has a `ModelWatch`."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.depth = 0
        self.roots: list[_Call] = []  # outermost training-mode calls not yet claimed by a watched model
        self.watches: list[ModelWatch] = []  # at most _MAX_WATCHES: the least recently stepped goes first
        self.models: list[str] = []  # the class of every model watched so far, in order
        self.model_ids: list[int] = []  # ... and its id
        self.current: ModelWatch | None = None  # the watch whose model was called last
        self.candidates: dict[int, Any] = {}  # id -> an outermost layer with parameters no watch has yet
        self.candidate_hooks: list[Any] = []
        self.patched = False  # Layer.__call__ is ours (until the first model is known)
        self.missed: dict[int, int] = {}  # id(optimizer) -> its updates before its model was found
        self.last_loss: Any = None
        self.backwards = 0  # backward calls so far: an optimizer is checked once per backward
        self.done = False
        self.failed: ModelWatch | None = None  # the watch of the first fault
        self.orig: dict[str, Any] = {}
        self.started = time.monotonic()
        # a doctor is replaying: its model's calls, backward and updates are its own, not the script's. Asked
        # several times a step by the seams, so a flag the doctors set (`replaying`), not a walk of the watches
        self.busy = False
        self._replays = 0
        self.process: dict[str, Any] | None = None  # a child process of the script's (processes.py), else None
        # The checked pass (recheck.py): this process re-runs the command to name a loss-code op
        self.recheck: Any = None
        if config.get("recheck_step") is not None:  # (imported only there: every watched process starts here)
            from nandoctor.zero_change.recheck import CheckedPass

            self.recheck = CheckedPass(config)

    def replaying(self, busy: bool) -> None:
        """A watch's doctor began (True) or ended (False) its replays (`Doctor.on_busy`): `busy` follows."""
        self._replays += 1 if busy else -1
        self.busy = self._replays > 0

    # ---- seams ----------------------------------------------------------------------------------------
    def layer_call(self, layer: Any, args: tuple, kwargs: dict) -> Any:
        call = self.orig["call"]
        if self.depth or self.busy:
            return call(layer, *args, **kwargs)
        training = layer.training
        # The RNG state before the call (a replay of step 0 needs its dropout masks): until the model is known
        root = _Call(layer, args, kwargs, sys.modules["paddle"].get_rng_state()) if training else None
        if root is not None:
            from nandoctor.zero_change.model_watch import call_site

            root.site = call_site(sys._getframe(1))  # the line that called it: a library model's caller
        self.depth += 1
        try:
            out = call(layer, *args, **kwargs)
        finally:
            self.depth -= 1
        if root is None:
            return out
        if self.recheck is not None and self.recheck.is_model(layer):
            # step 0: the model is not known yet, but its class is
            self.recheck.after_model(0, layer, args, kwargs, out)
        self._keep_root(root, out)
        return out

    def _keep_root(self, root: _Call, out: Any) -> None:
        from nandoctor.zero_change.capture import keep_grads

        root.output = out
        keep_grads(out, root.grads)
        self.roots.append(root)
        del self.roots[:-_MAX_ROOTS]
        layer = root.layer
        if (id(layer) not in self.candidates and len(self.candidates) < _MAX_CANDIDATES
                and next(iter(layer.parameters()), None) is not None
                and not any(w.model is layer for w in self.watches)):
            self.candidates[id(layer)] = layer

    def run_backward(self, run: Any) -> Any:
        """`loss.backward()` itself: under the checked pass's watch at its step."""
        return run() if self.recheck is None else self.recheck.backward(run)

    def backward(self, tensor: Any) -> None:
        if not self.busy:
            self.last_loss = tensor
            self.backwards += 1

    def before_step(self, optimizer: Any) -> bool:
        """True when the update may go ahead."""
        if self.busy or self.last_loss is None or self.done and not self.config.get("keep_going"):
            return True
        watch = self._watch_of(optimizer)
        if watch is None:
            if self.missed.get(id(optimizer), 0) > _MAX_MISSES:
                return True  # given up: no Layer's call kept trains its parameters
            watch = self._attach(optimizer)
            if watch is None:
                self._missed(optimizer)
                return True
        if watch.checked == self.backwards:  # no backward since this optimizer's last check
            return True
        watch.checked = self.backwards
        recheck = self.recheck
        if recheck is not None and recheck.armed and recheck.is_model(watch.model):
            recheck.not_reproduced(f"the checked pass saw no NaN/Inf op after the model's forward at step "
                                   f"{recheck.step} (the script may not run the same twice)")
        watch.tape_step()
        ok = watch.doctor.check(self.last_loss, watch.batch())
        if ok:
            return True
        if not self.done:  # the first fault; later ones (--keep-going) are counted and their updates dropped
            self._finish(watch)
        return False

    def after_step(self, optimizer: Any) -> None:
        if self.busy:  # a rollback's replay steps the optimizer: not a step of the script's
            return
        watch = self._watch_of(optimizer)
        if watch is not None:
            watch.doctor.updated()
            watch.after_update()

    def _missed(self, optimizer: Any) -> None:
        """An optimizer stepped whose model was not among the calls kept (a model trained after another
        one, whose first call came after the class patch was gone): the patch again, so its next update
        finds it; after a few updates without, it is given up (it may train no Layer at all)."""
        n = self.missed[id(optimizer)] = self.missed.get(id(optimizer), 0) + 1
        if n <= _MAX_MISSES and not self.patched and "patched_call" in self.orig:
            sys.modules["paddle"].nn.Layer.__call__ = self.orig["patched_call"]
            self.patched = True
        elif n == _MAX_MISSES + 1 and self.watches:
            self._switch_to_hooks()

    def _watch_of(self, optimizer: Any) -> ModelWatch | None:
        for watch in self.watches:  # (twice a step: a loop, not next() over a generator)
            if watch.optimizer is optimizer:
                return watch
        return None

    # ---- finding the model and the loss ------------------------------------------------------------------
    def _attach(self, optimizer: Any) -> ModelWatch | None:
        """An optimizer's first update: its model is the outermost layer whose parameters it trains."""
        from nandoctor.diagnosis.nan_params import optimizer_params

        trained = {id(p) for p in optimizer_params(optimizer)}
        found = self._model_call(lambda layer: sum(1 for p in layer.parameters() if id(p) in trained), trained)
        if found is None:
            return None
        best, loss_layer, labels = found
        report_dir = self.config.get("report_dir")
        sync = _sync()
        if sync is not None and report_dir is None:  # ranks merge through files: a folder beside the result
            report_dir = str(Path(self.config["result"]).with_name("ranks"))
        watch = self._watch(best, optimizer, loss_layer, labels, report_dir, sync)
        self._switch_to_hooks()
        mark(self.config, "watched")
        return watch

    def _attach_without_update(self) -> bool:
        """The script dies before its first update: the model is the outermost layer with most parameters
        (no collective: the other ranks are not checking with this one)."""
        found = self._model_call(lambda layer: len(list(layer.parameters())), None)
        if found is None:
            return False
        best, loss_layer, labels = found
        self._watch(best, None, loss_layer, labels, self.config.get("report_dir"), None)
        return True

    def _model_call(self, score: Any, trained: set[int] | None) -> tuple[_Call, Any, tuple] | None:
        """The outermost call kept whose layer scores highest (above 0), the loss layer called on its output
        (one that trains nothing else: not the discriminator a generator's output goes through) and its labels."""
        best, best_n = None, 0
        for root in self.roots:  # the latest call of the best: a GAN's generator is also called for D's batch,
            n = score(root.layer)  # whose output is detached (no gradient comes back to it)
            if n >= max(best_n, 1):
                best, best_n = root, n
        if best is None:
            return None
        loss_layer, labels = None, ()
        for root in self.roots:
            if root.layer is not best.layer and root.args and root.args[0] is best.output and (
                    trained is None or all(id(p) in trained for p in root.layer.parameters())):
                loss_layer, labels = root.layer, tuple(root.args[1:])
        return best, loss_layer, labels

    def _watch(self, best: _Call, optimizer: Any, loss_layer: Any, labels: tuple, report_dir: str | None,
               sync: Any) -> ModelWatch:
        if len(self.watches) >= _MAX_WATCHES:  # models trained one after another (a sweep): memory stays bounded
            self._retire(min((w for w in self.watches if w is not self.failed), key=lambda w: w.checked))
        from nandoctor.zero_change.model_watch import ModelWatch

        watch = ModelWatch(self, best.layer, optimizer, loss_layer, labels)
        if id(best.layer) in self.model_ids:  # one model, several optimizers (parameter groups): one model
            watch.index = self.model_ids.index(id(best.layer))
        else:
            watch.index = len(self.models)
            self.models.append(type(best.layer).__name__)
            self.model_ids.append(id(best.layer))
        self.watches.append(watch)
        self.current = watch
        # the model's calls are its watch's from now on: the others' stay for the optimizers still to come
        self.roots = [r for r in self.roots if r.layer is not best.layer]
        self.candidates.pop(id(best.layer), None)
        # steps count from the optimizer's first update, also when it was found at a later one
        watch.start(best, report_dir, sync, self._on_fault(), first_step=self.missed.pop(id(optimizer), 0))
        watch.hook()
        return watch

    def _retire(self, watch: ModelWatch) -> None:
        """The watch whose optimizer stepped least recently is closed (its last update checked) and let go."""
        self.watches.remove(watch)
        if self.current is watch:
            self.current = None
        watch.retire()
        report = watch.doctor.report
        if report is not None and report.exit_code and not self.done:  # its last update made NaN/Inf
            self.done, self.failed = True, watch
            self.write(self._named(watch, report))

    def _switch_to_hooks(self) -> None:
        """A model is known: Layer gets its own __call__ back (the other layers keep Paddle's fast path), and
        the outermost layers with parameters that no watch has yet are recorded by hooks, so an optimizer
        that steps later (a GAN's second one) finds its model among them."""
        if self.patched:
            sys.modules["paddle"].nn.Layer.__call__ = self.orig["call"]
            self.patched = False
        for handle in self.candidate_hooks:
            handle.remove()
        self.candidate_hooks = []
        for layer in self.candidates.values():
            self.candidate_hooks += self._record_calls(layer)

    def _record_calls(self, layer: Any) -> list[Any]:
        """Hooks that keep `layer`'s training-mode calls as roots (inputs, RNG, output, returned gradient)."""
        pending: list[_Call] = []

        def pre(_layer: Any, args: Any, kwargs: Any) -> None:
            if not self.busy and layer.training:
                pending.append(_Call(layer, tuple(args), dict(kwargs or {}), sys.modules["paddle"].get_rng_state()))

        def post(_layer: Any, _args: Any, out: Any) -> None:
            if pending:
                self._keep_root(pending.pop(), out)

        return [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_post_hook(post)]

    def crashed(self, exc: BaseException) -> None:
        """The script dies of an exception of its own: a `user_code.error` report (step, phase, layer), also
        when it dies before its first update (the model is then the outermost layer with most parameters)."""
        if self.done or self.recheck is not None or not isinstance(exc, Exception):
            return
        if not self.watches and not self._attach_without_update():
            return
        watch = self.current or self.watches[0]
        report = watch.doctor.crashed(exc, watch.fields() if watch.doctor._open else None)
        if report is not None:
            self.done = True
            self.write(self._named(watch, report))

    def reset_child(self, process: dict[str, Any]) -> None:
        """In a forked child: the parent's watches are not this process's (it trains on its own, and writes
        its own result): drop them, find the child's models afresh through the class patch."""
        try:
            for watch in self.watches:
                watch.drop()
            for handle in self.candidate_hooks:
                handle.remove()
        except Exception:  # noqa: BLE001 - the parent's hooks left in this child only cost time
            pass
        self.watches, self.candidate_hooks, self.candidates, self.roots, self.missed = [], [], {}, [], {}
        self.models, self.model_ids = [], []
        self.current = self.failed = self.last_loss = None
        self.backwards = self.depth = 0
        self.done = self.busy = False
        self._replays = 0
        self.started = time.monotonic()
        self.process = process
        if "patched_call" in self.orig and not self.patched:
            sys.modules["paddle"].nn.Layer.__call__ = self.orig["patched_call"]
            self.patched = True

    # ---- the end -------------------------------------------------------------------------------------
    def _on_fault(self) -> str:
        """--keep-going: every later faulty update is dropped too (the doctor's skip_step), else stop."""
        return "skip_step" if self.config.get("keep_going") else "stop"

    def _named(self, watch: ModelWatch, report: Any) -> Any:
        """With more than one model watched, the report says which one (its class and its optimizer's)."""
        if len(self.models) > 1 and report is not None:
            from nandoctor.zero_change.processes import name_model

            name_model(report, watch.index, self.models)
        return report

    def _finish(self, watch: ModelWatch) -> None:
        """A fault: outputs written; the script stopped unless --keep-going."""
        doctor = watch.doctor
        if self.recheck is not None:
            self.recheck.not_reproduced(f"the checked pass found a fault at step {doctor.fault.step}, before "
                                        f"step {self.recheck.step}: the script does not run the same twice")
        self.done = True
        self.failed = watch
        self.write(self._named(watch, doctor.report))
        if doctor.sync is not None:
            doctor.sync.barrier()  # rank 0's result is on disk before any rank exits
        if self.process is not None and in_pool_worker():
            return  # a Pool's worker that exits loses its task and the pool waits for it forever: it trains on
        if not self.config.get("keep_going"):
            for other in self.watches:
                other.doctor.close()
            sys.stdout.flush()
            raise SystemExit(1)

    def write(self, report: Any) -> None:
        """The result where the parent `nandoctor run` reads it: a child process's names the child."""
        if self.process is not None and report is not None:
            from nandoctor.zero_change.processes import mark_report

            mark_report(report, self.process)
        write_result(self.config, report, self.process)

    def at_exit(self) -> None:
        """The script ended on its own (--keep-going, or nothing found): close the watches, keep the report
        (a healthy one too: `--json` is written for every run)."""
        if not self.watches:
            return
        for watch in self.watches:
            watch.doctor.close()
        if not self.done:
            # every model's summary was read; the report is the first with a finding (a warning), else the first
            chosen = next((w for w in self.watches if w.doctor.report is not None), self.watches[0])
            self.write(self._named(chosen, chosen.doctor.summary()))
            return
        failed = self.failed
        if failed is not None and failed.doctor.report is not None and failed.doctor.skipped:  # --keep-going
            failed.doctor.report.details["skipped_steps"] = list(failed.doctor.skipped)
            self.write(self._named(failed, failed.doctor.report))

    def release(self) -> None:
        """After the report: let go of what this session kept of the script's (models, optimizers, their
        doctors with the snapshot ring and the taped steps, the calls' inputs and outputs) while Paddle's
        runtime is whole. This exit handler runs before Paddle's own, which clear its kernels, devices and
        process groups; a DataParallel model or a tensor still held here would be freed after them, during
        the interpreter's finalisation, where freeing it can crash the process (docs/paddle-teardown.md).
        What only a cycle of ours still holds is collected too, in a rank of a launch (the case of that
        doc); elsewhere a full collection costs ~60 ms at every exit (a 500-layer model: Paddle's own
        objects are most of what it walks), and what is left is freed with the script's own objects."""
        try:
            for watch in self.watches:
                watch.release()
            self.watches, self.roots, self.current, self.failed = [], [], None, None
            if _in_a_launch():
                import gc

                gc.collect()
        except Exception:  # noqa: BLE001 - the script is exiting: nothing of ours may raise into it
            pass


def write_result(config: dict[str, Any], report: Any, process: dict[str, Any] | None = None) -> None:
    """The report as JSON where the parent `nandoctor run` reads it (one file per rank, one per child
    process of the script's: report.pid<N>.json)."""
    from nandoctor.report import json as json_report
    from nandoctor.zero_change.processes import result_path

    path = result_path(Path(config["result"]), process)
    rank = os.environ.get("PADDLE_TRAINER_ID")
    if rank not in (None, "", "0"):
        path = path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    if report is not None:
        path.write_text(json_report.render(report), encoding="utf-8")


def _in_a_launch() -> bool:
    """A rank of `paddle.distributed.launch` (its variables), or a process that joined a process group."""
    if os.environ.get("PADDLE_TRAINER_ID") is not None or os.environ.get("PADDLE_TRAINERS_NUM") not in (None, "", "1"):
        return True
    dist = sys.modules.get("paddle.distributed")
    try:
        return bool(dist is not None and dist.is_initialized())
    except Exception:  # noqa: BLE001 - no distributed support in this build: one process
        return False


def mark(config: dict[str, Any], what: str) -> None:
    """Tell the parent how far the watch got (`watched`: a model and optimizer were found), by a file."""
    try:
        Path(config["result"]).with_name(what).touch()
    except OSError:
        pass


def _sync() -> Any:
    from nandoctor.parallel.distributed import RankSync, joined_ranks

    return RankSync() if joined_ranks() > 1 else None


SESSION: Session | None = None


def install() -> None:
    """From sitecustomize: a session when NANDOCTOR_RUN is set; the patches once Paddle is imported."""
    global SESSION
    raw = os.environ.get(ENV)
    if not raw or SESSION is not None:
        return
    try:
        config = json.loads(raw)
    except ValueError:
        return
    if config.get("recheck_step") is not None:  # the checked pass: the user's files stay as the real run left them
        from nandoctor.engine.sandbox import redirect_writes

        redirect_writes(Path(config["mirror"]), exempt=Path(config["result"]).parent)
    from nandoctor.zero_change import processes

    SESSION = Session(config)
    if config.get("recheck_step") is None:
        SESSION.process = processes.child_info()  # a spawned child of the script's: watched on its own
        processes.on_fork(SESSION)
        if SESSION.process is not None and SESSION.process["start"] == "spawn":
            processes.watch_exceptions(SESSION)
    _quiet_logger()
    if config.get("recheck_step") is None:
        previous = sys.excepthook

        def excepthook(kind: type, exc: BaseException, tb: Any) -> None:
            try:
                SESSION.crashed(exc)
            except Exception:  # noqa: BLE001 - never stand between the user and their traceback
                pass
            previous(kind, exc, tb)

        sys.excepthook = excepthook
    from nandoctor.zero_change.seams import AfterImport

    session = SESSION
    if "paddle" in sys.modules and hasattr(sys.modules["paddle"], "optimizer"):
        _on_paddle(session)
        return
    sys.meta_path.insert(0, AfterImport("paddle", lambda: _on_paddle(session)))


def _on_paddle(session: Session) -> None:
    """Paddle was imported: the seams, and the RNG states a checked pass needs (saved, or restored in it)."""
    from nandoctor.zero_change import recheck
    from nandoctor.zero_change.seams import patch_paddle

    patch_paddle(session)
    # The report is made at exit, with Paddle's ops: registered after Paddle's own exit handlers (which clear
    # its kernels), so it runs before them (atexit runs the latest first). Before, a model of more than 96
    # tensors ended with no report: its parameter check at the end had no kernels left.
    import atexit

    atexit.register(_at_exit)
    if session.recheck is not None:
        recheck.restore_rng(session.config["rng"])
    else:
        if session.process is None:  # (the command's own process: a checked pass re-runs the command)
            recheck.save_rng(session.config)
        _report_on_sigterm()


def _report_on_sigterm() -> None:
    """SIGTERM (`nandoctor run` passing on a timeout or a cancel) ends a script that has no handler of its
    own at once, without atexit: write the partial report first, then die of the signal as it would have.
    Set after `import paddle`, whose own C handler it replaces; a handler the script sets later wins."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum: int, _frame: Any) -> None:
        try:
            _at_exit()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)


def _at_exit() -> None:
    """The script ended on its own (--keep-going, or nothing found): close the watches, keep the report."""
    session = SESSION
    if session is not None and session.recheck is not None:
        session.recheck.not_reproduced(f"the script ended before step {session.recheck.step}")
    if session is None:
        return
    try:
        session.at_exit()
    except Exception as exc:  # noqa: BLE001 - never turn the user's exit into a traceback of ours, but say it
        try:  # to the parent, which tells the user the report was lost and whose fault that is (runner.py)
            Path(session.config["result"]).with_name(OWN_ERROR).write_text(f"{type(exc).__name__}: {exc}",
                                                                          encoding="utf-8")
        except OSError:
            pass
    finally:
        session.release()


def _quiet_logger() -> None:
    """The parent prints the report; the child's `nandoctor` logger stays silent."""
    import logging

    logger = logging.getLogger("nandoctor")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
