"""Test-only plugin: MDH-FL where site-2's copy of the public set lost its last image (a truncated copy).

Everything else is the real method: the real digest of the copy each site holds, the real server rule.
"""

from __future__ import annotations

import numpy as np

from medflare.data import ImageDataset
from medflare.methods.base import MethodSpec
from medflare.methods.mdhfl import MdhflConfig
from medflare.methods.mdhfl.client import MdhflTrainer
from medflare.methods.mdhfl.protocol import PAYLOAD
from medflare.methods.mdhfl.server import MdhflRule
from medflare.registry import register_method


class TruncatedCopyTrainer(MdhflTrainer):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        public = self.data.public
        if self.data.site_name == "site-2":
            kept = public.images.subset(np.arange(len(public) - 1))
            self.data.public = ImageDataset(kept, public.transform)


register_method(
    MethodSpec(
        name="test-mdhfl-truncated-copy",
        summary="test-only: MDH-FL with a truncated public copy at site-2",
        config_cls=MdhflConfig,
        trainer_cls=TruncatedCopyTrainer,
        payload=PAYLOAD,
        server_rule_cls=MdhflRule,
        server_model=False,
    )
)
