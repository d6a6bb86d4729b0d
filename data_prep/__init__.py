"""draftsmith.data_prep."""
