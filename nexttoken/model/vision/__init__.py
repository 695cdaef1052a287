"""The vision towers and projectors (issue 43): each family's encoder from pixel values to rows of the text
model's embedding width, one row per placeholder token (vcore owns this package's interface)."""
