"""An instance's role in a cluster's model group (the server's `role`, the router's view of it,
the simulator's instances)."""

from __future__ import annotations

from tandem.config.option import Choice


class InstanceRole(Choice):
    COLOCATED = "colocated"  # prefill and decode, as a standalone server does
    PREFILL = "prefill"
    DECODE = "decode"
