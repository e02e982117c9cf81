"""Triton emitters: one kernel of readable source per region."""
