"""OpenAI-compatible HTTP server: Flask app served by gunicorn with the gevent worker."""
