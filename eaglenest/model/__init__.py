"""The EAGLE-3 drafter and speculative decoding with it."""
