"""Which value a model runs with when the server's settings and the model's config both name one.

One rule for every setting a model's config also has (``max_batch_size``, ``max_queue_delay_ms``,
``max_queue_size``, ``engine``): a server-wide value set explicitly (a ``NOGRAD_`` variable or a
command-line flag) applies to every model, replacing its config's own (and a load call's
override); left unset, the server-wide value is only the default for models whose config says
nothing. Whoever deploys the server has the last word without editing every model's files, and
each replacement is logged once per model as it loads, so no one's value is lost in silence.
"""

from __future__ import annotations

import logging
from typing import Final

from nograd.schema.config import ModelConfig
from nograd.settings import Settings

logger = logging.getLogger(__name__)

SERVER_WIDE: Final = ("max_batch_size", "max_queue_delay_ms", "max_queue_size", "engine")
"""Settings of ``Settings`` that a model's config also sets, under the same name."""


def effective_config(config: ModelConfig, settings: Settings) -> ModelConfig:
    """``config`` with every explicitly set server-wide value in place of its own; each value
    replaced is logged (the model's own value differed)."""
    update: dict[str, object] = {}
    for name in SERVER_WIDE:
        if name not in settings.model_fields_set:
            continue
        value = getattr(settings, name)
        if name == "engine" and (not value or not config.takes_engine):
            # Empty: keep each config's own. Set, it applies to the models an engine may be
            # chosen for (``ModelConfig.takes_engine``); the others have one engine only.
            continue
        own = getattr(config, name)
        if own is not None and own != value:
            logger.info(
                "model %s: %s = %s from NOGRAD_%s replaces %s from its config "
                "(a server-wide setting that is set applies to every model)",
                config.name,
                name,
                value,
                name.upper(),
                own,
            )
        update[name] = value
    return config.model_copy(update=update) if update else config
