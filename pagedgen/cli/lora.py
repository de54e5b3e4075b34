"""The command line's LoRA adapters (docs/lora.md): ``--lora NAME=PATH`` (repeatable) and
``--lora-field FIELD`` (a row names its adapter).

- ``--lora`` turns on ``--enable-lora``; the adapters get ``lora_int_id`` 1, 2, ... in flag order.
- Without ``--lora-field`` one ``--lora`` applies to every row (several are an error: which one?).
- With it, a row's field holds one of the NAMEs; a row without the field, or with null or "", runs
  on the base model; another name is a bad row naming the known ones (``--on-error`` decides).
- The sidecar binds each adapter's name and files (``adapter_config.json``, ``adapter_model.*``:
  sizes and SHA-256, as for the model) and ``--lora-field``: a rerun with another adapter is refused.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from pagedgen.cli.errors import BadRow, CLIError
from pagedgen.lora.request import LoRARequest


def add_args(ap: argparse.ArgumentParser) -> None:
    group = ap.add_argument_group("LoRA adapters (docs/lora.md)")
    group.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                       help="a PEFT LoRA adapter folder and its name (repeatable; turns on --enable-lora; "
                            "--max-loras N runs N adapters in one step)")
    group.add_argument("--lora-field", default=None, metavar="FIELD",
                       help="the row field naming its adapter (a --lora NAME; absent, null or \"\": the base model)")


def adapters(args) -> dict[str, LoRARequest]:
    """{NAME: LoRARequest} of the ``--lora`` flags, in order (CLIError for a malformed or repeated one)."""
    out: dict[str, LoRARequest] = {}
    for item in args.lora or ():
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise CLIError(f"--lora {item!r}: expected NAME=PATH (a name and a PEFT adapter folder)")
        if name in out:
            raise CLIError(f"--lora {name!r} is given twice")
        if not os.path.isdir(path):
            raise CLIError(f"--lora {name}={path}: no such folder")
        out[name] = LoRARequest(name, len(out) + 1, path)
    if args.lora_field is not None and not out:
        raise CLIError("--lora-field needs the adapters it names: pass them with --lora NAME=PATH")
    if args.lora_field is None and len(out) > 1:
        raise CLIError(f"{len(out)} --lora adapters and no --lora-field: pass --lora-field FIELD (the row field naming each row's adapter)")
    if out:
        args.enable_lora = True
    return out


def check(llm, loras: dict[str, LoRARequest]) -> None:
    """Every adapter checked against the model before any row runs (CLIError naming it)."""
    for name, lora in loras.items():
        try:
            llm.processor.loras.check_one(lora, f"--lora {name}")
        except (TypeError, ValueError) as exc:
            raise CLIError(str(exc)) from None


def fingerprint(args, loras: dict[str, LoRARequest]) -> Optional[dict]:
    """What binds the output: each adapter's name and files, and ``--lora-field`` (None without adapters)."""
    from pagedgen.cli import sidecar

    if not loras:
        return None
    files = {}
    for name, lora in loras.items():
        entry = {}
        for file in sorted(os.listdir(lora.lora_path)):
            if file == "adapter_config.json" or file.startswith("adapter_model."):
                entry[file] = sidecar.hash_prefix(os.path.join(lora.lora_path, file))[0]
        files[name] = entry
    return {"adapters": files, "lora_field": args.lora_field}


class RowAdapters:
    """A row's adapter: ``__call__(fields) -> LoRARequest or None`` (BadRow for an unknown name)."""

    def __init__(self, loras: dict[str, LoRARequest], field: Optional[str]) -> None:
        self.loras, self.field = loras, field
        self.default = next(iter(loras.values())) if loras and field is None else None

    def __call__(self, fields: dict) -> Optional[LoRARequest]:
        if self.field is None:
            return self.default
        name = fields.get(self.field)
        if name is None or name == "":
            return None
        lora = self.loras.get(name) if isinstance(name, str) else None
        if lora is None:
            raise BadRow(f"field {self.field!r} names adapter {name!r}, not one of the --lora adapters ({', '.join(self.loras)})")
        return lora
