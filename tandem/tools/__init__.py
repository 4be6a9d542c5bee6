"""Command-line tools over traces and measurements: `tandem analyze`."""
