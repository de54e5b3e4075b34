"""Integrations with the tools pagedgen is used from (see docs/integrations.md).

- ``pagedgen.integrations.lm_eval``: an lm-evaluation-harness backend registered as ``pagedgen``
  (``pip install -e .[lm_eval]``); ``python -m pagedgen.integrations.lm_eval <lm_eval arguments>``.
- ``pagedgen.integrations.ray``: ``LLMPredictor``, a callable class for Ray Data's ``map_batches``
  over an actor pool (``pip install -e .[ray]``).

Importing this package imports neither optional dependency.
"""
