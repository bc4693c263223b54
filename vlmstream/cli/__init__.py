"""The roof: the `vlmstream` command and the tools built on every layer below (run, replay, status, redrive,
export). Nothing below imports from here."""
