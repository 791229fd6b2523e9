"""Data sets beyond the built-in ones: your own (``data.name = "pkg.module:factory"``) and token files
written by ``tandem data prepare-text`` (``data.name = "tokens"``). See docs/data.md."""
