"""lm-evaluation-harness backend ``pagedgen`` (``pip install -e .[lm_eval]``; docs/integrations.md).

Importing this package registers the model name ``pagedgen`` with lm_eval's ``@register_model``
(lm_eval 0.4.13 has no plugin discovery), so that::

    import pagedgen.integrations.lm_eval
    import lm_eval
    lm_eval.simple_evaluate(model="pagedgen", model_args="pretrained=DIR,dtype=float32,device=cpu", tasks=[...])

works, as does passing ``PagedGenLM(pretrained=DIR, ...)`` as the model. From the shell,
``python -m pagedgen.integrations.lm_eval --model pagedgen ...`` registers it and runs lm_eval's CLI.
"""
from pagedgen.integrations.lm_eval.model import LM_ARGS, PagedGenLM

__all__ = ["PagedGenLM", "LM_ARGS"]
