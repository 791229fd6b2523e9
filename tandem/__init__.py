"""tandem: take a PyTorch training job from one GPU to many machines and into serving."""

__version__ = "0.1.0"
