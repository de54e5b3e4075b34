"""``python -m pagedgen.integrations.lm_eval <lm_eval's CLI arguments>``: lm_eval's own command line
(``lm-eval run ...``; the subcommand may be left out, as with ``lm-eval``) with the ``pagedgen``
backend registered first, e.g.::

    python -m pagedgen.integrations.lm_eval --model pagedgen \\
        --model_args pretrained=../shared/models/stories260K,dtype=float32 \\
        --include_path my_tasks --tasks my_task --limit 20

Without ``--device`` (or ``device=`` in ``--model_args``) the model runs on this machine's GPU if it
has one, else on the CPU (lm_eval's own CLI would pass ``cuda:0``).
"""
import sys

import pagedgen.integrations.lm_eval  # noqa: F401  (registers the "pagedgen" model)


def with_default_device(argv: list[str]) -> list[str]:
    """``argv`` with ``--device cuda`` or ``--device cpu`` (whichever this machine has) added when it
    names no device, neither as ``--device`` nor as ``device=`` in ``--model_args``: lm_eval's CLI
    would otherwise hand the model ``cuda:0``, which a machine without a GPU refuses."""
    if any(a == "--device" or a.startswith("--device=") for a in argv):
        return list(argv)
    for i, a in enumerate(argv):
        model_args = argv[i + 1] if a == "--model_args" and i + 1 < len(argv) else a[len("--model_args="):] if a.startswith("--model_args=") else None
        if model_args is not None and any(part.strip().startswith("device=") for part in model_args.split(",")):
            return list(argv)
    import torch

    return [*argv, "--device", "cuda" if torch.cuda.is_available() else "cpu"]


def main(argv=None) -> None:
    """Run lm_eval's CLI on ``argv`` (default: this process's arguments), with this machine's device
    when the arguments name none (``with_default_device``)."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv = [sys.argv[0], *with_default_device(sys.argv[1:] if argv is None else list(argv))]
    cli_evaluate()


if __name__ == "__main__":
    main()
