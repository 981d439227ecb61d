"""``draftctl bench``: every controller side by side in real decoding."""
