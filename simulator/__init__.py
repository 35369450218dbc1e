"""The scheduler simulator on a virtual clock (its issue adds the contents)."""
