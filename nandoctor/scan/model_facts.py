"""Facts the data checks read from the model: its position tables and the width of its output.

Kept apart from data.py because these are the only places the data scan touches the model, and they
must leave it exactly as they found it (eval mode restored, no gradients recorded).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np


def position_tables(model: Any) -> list[tuple[str, int]]:
    """(dotted name, num_embeddings) of every nn.Embedding whose name says it holds positions."""
    import paddle

    out = []
    for name, layer in model.named_sublayers():
        if isinstance(layer, paddle.nn.Embedding) and "pos" in name.lower():
            out.append((name, int(layer.weight.shape[0])))
    return out


def infer_num_classes(model: Any, inputs: list[Any], label: Any,
                      call: Callable[..., Any]) -> tuple[int | None, str]:
    """The number of classes from the model's output width on one batch, or None and why not.

    Only when the label is an integer array and the output is a 2-D+ tensor whose leading dims match
    the label's (logits [B, C] for labels [B] or [B, 1]; [B, L, V] for [B, L]) and whose last dim is
    > 1: anything else (regression, NCHW segmentation logits) would give a wrong count, so no guess.
    `call` runs the model as the user's code (exceptions become UserCodeError).
    """
    import paddle

    from nandoctor.tensors.convert import to_numpy, to_tensor

    label_arr = to_numpy(label)
    if label_arr is None or label_arr.dtype.kind not in "iu":
        return None, "the label is not an integer array"
    was_training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            outputs = call(model, *[to_tensor(x) for x in inputs])
    finally:
        if was_training:
            model.train()
    if isinstance(outputs, (tuple, list)) and outputs:
        outputs = outputs[0]
    shape = getattr(outputs, "shape", None)
    if shape is None or len(shape) < 2 or int(shape[-1]) <= 1:
        shown = None if shape is None else list(shape)
        return None, f"the model's output has shape {shown}, not [..., classes]"
    out_lead = [int(s) for s in shape[:-1]]
    lab_shape = list(label_arr.shape)
    if len(lab_shape) == len(out_lead) + 1 and lab_shape[-1] == 1:
        lab_shape = lab_shape[:-1]
    if lab_shape != out_lead:
        return None, (f"the model's output shape {list(shape)} does not line up with the label shape "
                      f"{list(np.shape(label_arr))}")
    return int(shape[-1]), f"the width of the model's output ({int(shape[-1])}) on the first batch"
