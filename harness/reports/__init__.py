"""What a run leaves: report.json assembled by ``report``, and the views rendered from JSON
(``markdown``, ``html_page``, ``junit``, ``figures``), over a folder loaded by ``bundle``."""
