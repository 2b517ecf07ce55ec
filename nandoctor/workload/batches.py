"""Whatever the user's loader yields -> named fields, the model's inputs and the label.

Batches come as a single tensor, a tuple/list (named by `data.fields`) or a dict (its own keys); the
values as Paddle tensors or numpy arrays. Naming happens once here so that every finding can say
"batch 3, sample 7, field 'x'" in the user's own words.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nandoctor.errors import SpecError
from nandoctor.tensors.convert import not_a_tensor

if TYPE_CHECKING:  # (annotations only: a watched process does not load the spec's parser)
    from nandoctor.spec import DataSpec


def default_field_names(n: int) -> list[str]:
    """Names for an unnamed tuple batch: (x, label) for the common pair, x0..xN otherwise."""
    if n == 1:
        return ["x"]
    if n == 2:
        return ["x", "label"]
    return [f"x{i}" for i in range(n)]


@dataclass
class BatchLayout:
    """How to read a batch: resolved once from the spec and the first batch, then reused."""

    data: DataSpec
    where: str  # "config.yaml" for messages
    # tuple/list batch length -> its names, once a batch of that length passed the checks below (they depend
    # on the length alone): a 0.3 ms step pays for naming its batch, not for re-deciding it
    _named: dict[int, tuple[str, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def fields(self, batch: Any, batch_index: int) -> dict[str, Any]:
        """Name the parts of a batch; a mismatch with `data.fields` is a SpecError naming the batch."""
        kind = type(batch)
        if kind is tuple or kind is list:
            names = self._named.get(len(batch))
            if names is not None:
                return dict(zip(names, batch))
        out = self._fields(batch, batch_index)
        if (kind is tuple or kind is list) and len(out) == len(batch):  # (repeated names: never cached)
            self._named[len(batch)] = tuple(out)
        return out

    def _fields(self, batch: Any, batch_index: int) -> dict[str, Any]:
        if isinstance(batch, Mapping):
            out = dict(batch)
            if self.data.fields is not None:
                missing = [f for f in self.data.fields if f not in out]
                if missing:
                    raise SpecError(f"{self.where}: `data.fields` names {missing}, but batch {batch_index} is a "
                                    f"dict with keys {list(out)}. Dict batches keep their own keys: drop "
                                    "`data.fields` or use those keys.")
        elif isinstance(batch, (tuple, list)):
            names = self.data.fields or default_field_names(len(batch))
            if len(names) != len(batch):
                raise SpecError(f"{self.where}: `data.fields` names {len(names)} fields {names}, but batch "
                                f"{batch_index} from {self.data.entry} has {len(batch)} parts. List one name "
                                "per part, in order.")
            out = dict(zip(names, batch))
        else:
            names = self.data.fields or ["x"]
            if len(names) != 1:
                raise SpecError(f"{self.where}: `data.fields` names {names}, but batch {batch_index} is a single "
                                f"{type(batch).__name__}, not a tuple or dict.")
            out = {names[0]: batch}
        for key in [self.data.label, *self.input_fields()]:
            if key is not None and key not in out:
                which = "data.label" if key == self.data.label else "data.inputs"
                raise SpecError(f"{self.where}: `{which}` names field '{key}', but batch {batch_index} has "
                                f"fields {list(out)}.")
        return out

    def input_fields(self) -> list[str]:
        """The field names `data.inputs` gives (the values of a keyword mapping); [] when not given."""
        inputs = self.data.inputs
        if isinstance(inputs, dict):
            return list(inputs.values())
        return list(inputs or [])

    def model_call(self, fields: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """(positional, keyword) arguments for the model: keyword when `data.inputs` is a mapping."""
        if isinstance(self.data.inputs, dict):
            return [], {arg: fields[name] for arg, name in self.data.inputs.items()}
        return self.inputs(fields), {}

    def check_model_inputs(self, fields: Mapping[str, Any]) -> None:
        """A text or ragged field among the model's inputs is a SpecError naming it and `data.inputs`."""
        names = self.input_fields() if self.data.inputs is not None else self.input_names(fields)
        for name in names:
            why = not_a_tensor(fields.get(name))
            if why is None:
                continue
            if self.data.inputs is None:
                now = (f"`data.inputs` is not set, so every field but the label goes to the model: "
                       f"{self.input_names(fields)}; list the ones it takes, e.g. `inputs: "
                       f"[{', '.join(n for n in self.input_names(fields) if n != name) or 'input_ids'}]`")
            else:
                now = f"`data.inputs` passes it to the model ({self.data.inputs})"
            raise SpecError(f"{self.where}: field '{name}' holds {why}, which cannot be turned into a tensor for "
                            f"the model; {now}. Tokenize it in your collate_fn (ids as a padded array), or leave "
                            "it out of `data.inputs`.")

    def label_name(self, fields: Mapping[str, Any]) -> str | None:
        if self.data.label is not None:
            return self.data.label
        return "label" if "label" in fields else None

    def input_names(self, fields: Mapping[str, Any]) -> list[str]:
        if self.data.inputs is not None:
            return self.input_fields()
        label = self.label_name(fields)
        return [k for k in fields if k != label]

    def inputs(self, fields: Mapping[str, Any]) -> list[Any]:
        return [fields[k] for k in self.input_names(fields)]

    def label(self, fields: Mapping[str, Any]) -> Any:
        name = self.label_name(fields)
        return None if name is None else fields[name]
