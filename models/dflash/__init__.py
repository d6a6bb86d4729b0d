"""The dflash draft method."""
