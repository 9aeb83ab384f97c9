"""Model construction through open_clip (any architecture, HF text towers), freezing rules, loading."""
