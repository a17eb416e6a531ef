"""Packed micro-batches: packing and the CP split (:mod:`.packing`), merged batches for the
no-grad passes (:mod:`.merge`), and batches to and from the model (:mod:`.transport`)."""
