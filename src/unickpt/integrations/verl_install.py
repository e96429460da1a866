"""Importing this module runs ``unickpt.integrations.verl.install()``: the opt-in for verl jobs
whose workers are processes the user does not start (Ray actors). verl imports the modules named
in ``VERL_USE_EXTERNAL_MODULES`` in every process that imports verl, so

    export VERL_USE_EXTERNAL_MODULES=unickpt.integrations.verl_install

in the environment of the workers makes each of them build ``UnickptFSDPCheckpointManager``
(docs/integrations/verl.md)."""

from __future__ import annotations

from .verl import install

INSTALLED = install()
