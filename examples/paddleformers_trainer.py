"""A PaddleFormers `Trainer` watched by nandoctor's callback (needs `pip install paddleformers`).

The model is plain_loop.py's Siamese distance model, returning its own loss from `labels` as
PaddleFormers models do; batch 6 holds the duplicated pair whose sqrt gradient is NaN.

    python examples/paddleformers_trainer.py OUTPUT_DIR            # writes OUTPUT_DIR/nandoctor-report, exit 1
"""

from __future__ import annotations

import sys

import paddle
import paddle.nn.functional as F
from paddleformers.trainer import Trainer, TrainingArguments

from nandoctor.integrations.paddleformers import NanDoctorCallback

try:
    from examples.plain_loop import Siamese, batches
except ImportError:  # run as a script from the examples folder
    from plain_loop import Siamese, batches


class PairModel(Siamese):
    def forward(self, a: paddle.Tensor, b: paddle.Tensor, labels: paddle.Tensor | None = None) -> dict:
        out = super().forward(a, b)
        return {"loss": F.mse_loss(out, labels), "logits": out} if labels is not None else {"logits": out}


def main(output_dir: str, healthy: bool = False) -> int:
    paddle.seed(0)
    model = PairModel()
    samples = [{"a": a[i], "b": b[i], "labels": t[i]} for a, b, t in batches(healthy) for i in range(len(a))]
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, num_train_epochs=1,
                             learning_rate=0.003, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                             logging_steps=1, save_strategy="no", report_to=[], seed=0, max_grad_norm=0.0,
                             dataloader_shuffle=False, disable_tqdm=True, amp_master_grad=False)
    doctor = NanDoctorCallback(report_dir=f"{output_dir}/nandoctor-report")
    trainer = Trainer(model=model, args=args, train_dataset=samples, callbacks=[doctor])
    trainer.train()
    return 1 if doctor.report is not None and doctor.report.exit_code else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "pf-out", healthy="--healthy" in sys.argv))
