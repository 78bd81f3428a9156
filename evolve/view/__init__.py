"""What a person sees of an evolution run: its history and figures."""
