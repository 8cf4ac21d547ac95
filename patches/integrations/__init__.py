"""What is specific to one upstream (coqui Trainer, XTTS, ...): names, call sites, versions."""
