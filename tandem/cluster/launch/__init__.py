"""Launching: `tandem cluster up` starts instances (local processes or Ray actors) and the
router."""
