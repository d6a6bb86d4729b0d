"""draftsmith.eval."""
