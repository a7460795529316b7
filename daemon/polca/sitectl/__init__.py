"""``polca site``: the site's power tree (``check`` now; the site controller grows here)."""
