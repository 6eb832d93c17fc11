"""Engine integrations: adapters that map an inference engine's hooks onto ``kvtier.offload``."""
