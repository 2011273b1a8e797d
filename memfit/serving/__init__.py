"""Code MLflow runs to serve a memfit export (models-from-code: nothing pickled)."""
