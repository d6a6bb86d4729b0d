"""The mlp_speculator draft method."""
