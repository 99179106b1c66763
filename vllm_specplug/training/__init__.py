"""EAGLE-3 draft-head training from extracted hidden states."""
