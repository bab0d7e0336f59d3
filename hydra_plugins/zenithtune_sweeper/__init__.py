"""The zenithtune Hydra sweeper: `hydra/sweeper=zenithtune` (selected by zenithtune's config.yaml)."""
