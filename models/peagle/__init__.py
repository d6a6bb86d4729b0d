"""The peagle draft method."""
