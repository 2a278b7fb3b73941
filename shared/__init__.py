"""Code both services use: configuration helpers, errors, the model store."""
