"""State that several gateway instances share through Redis: the key layout and the sync task."""
