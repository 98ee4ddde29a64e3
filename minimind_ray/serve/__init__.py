"""Serve trained models on Ray Serve: an OpenAI-compatible API and a chat page.

``app.py`` the FastAPI ingress and the Serve deployment; ``engine.py`` the continuous-batching
generation loop; ``protocol.py`` requests, errors and reply text; ``options.py`` what one
deployment is; ``serve_verb.py`` the command; ``model_io.py`` the one door into the model, weights,
tokenizer and MLflow code; ``static/index.html`` the chat page. See docs/serving.md.
"""
