"""Loss landscapes of ReLU networks: 1D/2D surfaces, toy networks, fixed-weight planes."""

__all__: list[str] = []
