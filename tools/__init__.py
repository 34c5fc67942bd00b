"""Tools for the course's maintainers; a reader's run never imports them."""
