"""Speculative decoding: drafts proposed before a decode step and verified in it
(``decoding``), by n-grams of the request's own text or by a smaller draft model
(``draft_model``)."""
