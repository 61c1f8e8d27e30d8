"""Flow-matching objective and noise: nothing of training/ outside flow/, nor data, models, sampling."""
