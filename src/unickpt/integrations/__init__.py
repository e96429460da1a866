"""Trainer integrations: unickpt as the checkpoint backend of a training framework.

One module per framework (``unickpt.integrations.lightning``, ``unickpt.integrations.torchtitan``,
``unickpt.integrations.accelerate`` and ``unickpt.integrations.hf_trainer`` for Hugging Face,
``unickpt.integrations.verl``),
each importing its framework only when it is imported itself, so ``import unickpt`` imports none
of them. Each is an extra (``pip install 'unickpt[lightning]'``) and has a page under
``docs/integrations/``.
"""
