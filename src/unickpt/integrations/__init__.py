"""Trainer integrations: unickpt as the checkpoint backend of a training framework.

Each submodule imports its framework when it is imported itself (``import unickpt`` imports
none of them) and is installed with its extra, e.g. ``pip install 'unickpt[lightning]'`` for
``unickpt.integrations.lightning``.
"""
