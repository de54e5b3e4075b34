"""``python -m pagedgen.integrations.lm_eval <lm_eval's CLI arguments>``: lm_eval's own command line
(``lm-eval run ...``; the subcommand may be left out, as with ``lm-eval``) with the ``pagedgen``
backend registered first, e.g.::

    python -m pagedgen.integrations.lm_eval --model pagedgen \\
        --model_args pretrained=../shared/models/stories260K,dtype=float32 --device cpu \\
        --include_path my_tasks --tasks my_task --limit 20
"""
import sys

import pagedgen.integrations.lm_eval  # noqa: F401  (registers the "pagedgen" model)


def main(argv=None) -> None:
    """Run lm_eval's CLI on ``argv`` (default: this process's arguments)."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
