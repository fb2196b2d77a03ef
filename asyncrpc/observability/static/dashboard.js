fetch("/api/job").then(r => r.json()).then(j => { document.getElementById("workers").textContent = j.workers.length + " workers"; });
